/* 4-bit and 8-bit GEMV for float32 activations on CPU: out[m, n] = sum_k x[m, k] * w[n, k]
 * for a few rows m (decode batches), reading the weights as GGUF blocks of 32.
 *
 * Built by service/model/native_gemv.py with the system C compiler and loaded through ctypes
 * (the GIL is released for the call). OpenMP resolves to the libgomp torch already loaded,
 * so the kernel shares the calling thread's worker pool.
 *
 * Why: torch's _weight_int4pack_mm_for_cpu is fast for bf16 activations only; with float32
 * (CPUs without AVX512-BF16, where kvfence computes in float32) it ran 6-19x slower than the
 * dense float32 matmul it was meant to beat, so such hosts read ~540 MB of float32 weights a
 * token instead of ~85 MB of blocks.
 *
 * Layout of one output row n (G = k / 32 blocks; the scale arrays hold G rounded up to a
 * multiple of 8, the padding 0, so they convert 8 at a time):
 *   4-bit: G x 16 bytes of nibbles, then G fp16 scales d, then G fp16 minimums m; byte j
 *          of a block holds element j (low nibble) and j + 16 (high), as ggml's Q4_0/Q4_1
 *          do, and w = d * q + m.
 *   8-bit (q8): G x 32 int8 q, then G fp16 scales d; w = d * q (ggml's Q8_0).
 * The wide layouts (KVF_WIDE) hold GGUF's K-quants, whose sub-block scales are float32
 * products (the super-block's fp16 scale times a 6-bit or int8 integer) fp16 cannot hold:
 *   4-bit wide: G x 16 bytes of nibbles as above, then G float32 scales, then G float32
 *          minimums (Q4_K: sub-blocks of 32 with a scale and a minimum each);
 *   8-bit wide: G x 32 int8 q, then G float32 scales of codes 0-15 of each block, then G
 *          of codes 16-31 (Q6_K: sub-blocks of 16 with a scale each).
 * Then sum_k x_k w_k = sum_blocks (d * sum_j q_j x_j + m * sum_j x_j). The x sums are
 * float32, taken once per call. For sum_j q_j x_j the SIMD path rounds each block of x to
 * int16 with its own scale s = max|x| / 32767 (relative error <= 2^-16 of the block's largest
 * value, 128x finer than rounding x to bf16) and multiplies in exact integer arithmetic
 * (vpmaddwd): |sum| <= 32 * 128 * 32767 < 2^31. The plain C path multiplies in float32.
 * NOTE: measured on SmolLM2-135M against transformers in float32 (make parity): decode
 * logits within 0.01, greedy tokens identical. A second int16 part for the remainder
 * (2^-31, float32 parity) made the B=1 forward ~35% slower on a 2-core AVX2 EPYC.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
/* In a weight's q8 argument: bit 0 says 8-bit blocks; KVF_TILES allows the tile path. */
#define KVF_TILES 2
/* In a weight's q8 argument: the weights are in the panel layout (q4_panels below). */
#define KVF_PANELS 4
/* In a weight's q8 argument: the row layout's scales (and minimums) are float32, and 8-bit
 * blocks have two scales, one per 16 codes (the wide layouts above). */
#define KVF_WIDE 8
/* Rows (a step's tokens) in one call: the per-row work is the same at any count (the
 * scratch is on the heap), so a batch-invariant step sends all its tokens in one call; the
 * packs' max_rows picks how many a batch-variant step sends here. */
#define MAX_ROWS 65536
#define INT16_STEPS 32767.0f
#define MAX_GROUPS 2048 /* k <= 65536: the SIMD path keeps a tile's scales on the stack */

static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        if (mant == 0) { v.u = sign; return v.f; }
        int e = -1; /* subnormal half: normalize */
        do { mant <<= 1; ++e; } while ((mant & 0x400u) == 0);
        v.u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
        return v.f;
    }
    if (exp == 31) { v.u = sign | 0x7f800000u | (mant << 13); return v.f; }
    v.u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    return v.f;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16_to_f32(h);
}


int kvf_q4_max_rows(void) { return MAX_ROWS; }

/* Per-call work on x shared by every output row: the input itself (after the fused
 * activation and norm, if any), its block sums, and (SIMD) its int16 blocks. */
typedef struct {
    float *x;       /* [rows, k] the GEMV's input */
    float *sum;     /* [rows, G padded to 8] exact float32 block sums (padding 0) */
    float *scale;   /* [rows, G padded to 8] int16 step of each block (padding 0) */
    int16_t *q;     /* [rows, k] x / step, rounded */
    int accumulate; /* out += the product (a residual add), instead of out = */
} prepared_x;

/* One output value: the product, or (accumulate) out's value plus the product, rounded as
 * torch's out.add_(product) rounds it. */
static inline void store(const prepared_x *p, float *dst, float value) {
    *dst = p->accumulate ? *dst + value : value;
}

/* ``gated``'s values: no gate, silu(gate) * up (SwiGLU), gelu_tanh(gate) * up (GeGLU). */
enum { GATE_NONE, GATE_SILU, GATE_GELU_TANH, GATE_KINDS };

/* The input row v [k] from x: with ``gated``, x has 2k columns [gate | up] and
 * v = act(gate) * up (GATE_SILU: silu, GATE_GELU_TANH: gelu with the tanh approximation);
 * with ``gamma``, v is then RMS-normalized and scaled by gamma
 * (v * gamma / sqrt(mean(v^2) + eps)), as F.rms_norm computes it. */
static void silu_gate(const float *x, int k, float *v);
static void gelu_gate(const float *x, int k, float *v);

static void input_row(const float *x, int k, int gated, const float *gamma, float eps,
                      float *v) {
    if (gated == GATE_GELU_TANH) {
        gelu_gate(x, k, v);
    } else if (gated) {
        silu_gate(x, k, v);
    } else {
        memcpy(v, x, sizeof(float) * (size_t)k);
    }
    if (gamma != NULL) {
        float ss = 0.0f;
        for (int j = 0; j < k; ++j) ss += v[j] * v[j];
        const float inv = 1.0f / sqrtf(ss / (float)k + eps);
        for (int j = 0; j < k; ++j) v[j] = v[j] * inv * gamma[j];
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVF_SIMD 1

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A block of x's sum and largest magnitude (a NaN shows in the sum, an inf in both). */
static inline void block_sum_max(const float *xp, float *sum, float *top) {
    const __m256 a = _mm256_loadu_ps(xp), b = _mm256_loadu_ps(xp + 8);
    const __m256 c = _mm256_loadu_ps(xp + 16), d = _mm256_loadu_ps(xp + 24);
    *sum = hsum8(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a, abs), _mm256_and_ps(b, abs)),
                                   _mm256_max_ps(_mm256_and_ps(c, abs), _mm256_and_ps(d, abs)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    *top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* exp of 8 floats: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by the degree-6
 * polynomial of kvcache/backends/cpu_decode.c (relative error ~2e-7). x is clamped to
 * [-87, 88.7] (a NaN stays NaN: the clamps return their second operand on NaN); above 88.7
 * it gives inf, as expf overflows. */
static inline __m256 exp8(__m256 x) {
    static const float poly[7] = {1.5353362e-4f, 1.3398874e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                  2.4022651e-1f, 6.9314718e-1f, 1.0f};
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.7f), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(poly[0]);
    for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(poly[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    const __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

/* v = silu(x[:k]) * x[k:] = x / (1 + exp(-x)) * up, 8 at a time (k is a multiple of 32).
 * NOTE: measured on a 2-core AVX2 EPYC: with expf a value the down projection's call at one
 * row (k = 1536) took ~8 us more than without the gate, 30 times a step. */
static void silu_gate(const float *x, int k, float *v) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < k; j += 8) {
        const __m256 g = _mm256_loadu_ps(x + j);
        const __m256 e = exp8(_mm256_xor_ps(g, neg));
        _mm256_storeu_ps(v + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                              _mm256_loadu_ps(x + k + j)));
    }
}

/* v = gelu_tanh(x[:k]) * x[k:], 8 at a time: 0.5 g (1 + tanh(u)) with
 * u = sqrt(2 / pi) (g + 0.044715 g^3) is g / (1 + exp(-2u)), silu_gate's form at 2u. */
static void gelu_gate(const float *x, int k, float *v) {
    const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(-2.0f * 0.7978845608028654f);
    const __m256 cube = _mm256_set1_ps(0.044715f);
    for (int j = 0; j < k; j += 8) {
        const __m256 g = _mm256_loadu_ps(x + j);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(cube, g), _mm256_mul_ps(g, g), g);
        const __m256 e = exp8(_mm256_mul_ps(c, inner));
        _mm256_storeu_ps(v + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                              _mm256_loadu_ps(x + k + j)));
    }
}

/* round(x * inv) of a block as int16 in element order (round half to even, as lrintf). */
static inline void block_to_int16(const float *xp, float inv, int16_t *qp) {
    const __m256 vi = _mm256_set1_ps(inv);
    for (int h = 0; h < 2; ++h) {
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp + 16 * h), vi));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp + 16 * h + 8), vi));
        /* packs works per 128-bit lane: put the four 64-bit quarters back in order */
        const __m256i q = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
        _mm256_storeu_si256((__m256i *)(qp + 16 * h), q);
    }
}
#else
static void silu_gate(const float *x, int k, float *v) {
    for (int j = 0; j < k; ++j) v[j] = x[j] / (1.0f + expf(-x[j])) * x[k + j];
}

static void gelu_gate(const float *x, int k, float *v) {
    for (int j = 0; j < k; ++j) {
        const float g = x[j], u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        v[j] = g / (1.0f + expf(-2.0f * u)) * x[k + j];
    }
}

static inline void block_sum_max(const float *xp, float *sum, float *top) {
    float s = 0.0f, t = 0.0f;
    for (int j = 0; j < BLOCK; ++j) {
        s += xp[j];
        t = fmaxf(t, fabsf(xp[j]));
    }
    *sum = s;
    *top = t;
}

static inline void block_to_int16(const float *xp, float inv, int16_t *qp) {
    for (int j = 0; j < BLOCK; ++j) qp[j] = (int16_t)lrintf(xp[j] * inv);
}
#endif

/* ---- Per-thread scratch on the heap, grown on demand, kept between calls (a decode step
 * makes ~120 calls; malloc and free each time cost more than the smallest GEMVs) and freed
 * when its thread exits (a pthread key's destructor). The row loops' weight-scale tables
 * live here rather than on the OpenMP workers' stacks. */
enum { SCRATCH_PREPARE, SCRATCH_STEPS, SCRATCH_AMX, SCRATCH_PANEL, SCRATCH_PANEL_CODES,
       SCRATCH_SLOTS };
/* One worker's tables of weight scale times x step: rows_q4/rows_q8 use 4 x MAX_GROUPS, tile
 * 2 x TILE x MAX_GROUPS floats (TILE is 4). */
#define STEP_FLOATS (8 * MAX_GROUPS)

typedef struct {
    void *buf[SCRATCH_SLOTS];
    size_t bytes[SCRATCH_SLOTS];
} thread_scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_made = 0;
static int64_t scratch_threads = 0; /* threads holding scratch now (kvf_q4_scratch_threads) */

static void scratch_free(void *held) {
    thread_scratch *s = (thread_scratch *)held;
    for (int i = 0; i < SCRATCH_SLOTS; ++i) free(s->buf[i]);
    free(s);
    __atomic_sub_fetch(&scratch_threads, 1, __ATOMIC_RELAXED);
}

static void scratch_key_make(void) {
    scratch_key_made = pthread_key_create(&scratch_key, scratch_free) == 0;
}

/* This thread's buffer ``slot`` of at least ``bytes`` (64-byte aligned), or NULL without
 * memory. The contents are kept only while the size does not grow. */
static void *thread_buffer(int slot, size_t bytes) {
    pthread_once(&scratch_once, scratch_key_make);
    if (!scratch_key_made) return NULL;
    thread_scratch *s = (thread_scratch *)pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = (thread_scratch *)calloc(1, sizeof *s);
        if (s == NULL) return NULL;
        if (pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
        __atomic_add_fetch(&scratch_threads, 1, __ATOMIC_RELAXED);
    }
    if (bytes > s->bytes[slot]) {
        const size_t size = (bytes + 63) & ~(size_t)63;
        free(s->buf[slot]);
        s->buf[slot] = aligned_alloc(64, size);
        s->bytes[slot] = s->buf[slot] == NULL ? 0 : size;
    }
    return s->buf[slot];
}

/* This thread's weight-scale tables; the caller reserved them (thread_buffer) first. */
static inline float *thread_steps(void) {
    return (float *)((thread_scratch *)pthread_getspecific(scratch_key))->buf[SCRATCH_STEPS];
}

/* Threads that hold scratch now (a thread's is freed when it exits). */
int64_t kvf_q4_scratch_threads(void) { return __atomic_load_n(&scratch_threads, __ATOMIC_RELAXED); }
/* ---- end of the per-thread scratch ---- */

/* Below this a block's largest |x| takes a power-of-two step (tiny_block_to_int16): the
 * ordinary step's 32767 / top overflows float32 from ~1e-34 down. */
#define TINY_TOP 0x1p-96f

/* A tiny block (0 < top < TINY_TOP) as int16 with the exact step 2^(e - 14), e = ilogb(top),
 * fewer if top would round past 32767: x / step is exact (a power of two) and only the
 * rounding to integers is lost, as in the ordinary path. Answers the step (below ~2^-135 it
 * underflows to 0 and the block adds nothing, as float32 products of such inputs do). */
static float tiny_block_to_int16(const float *xp, float top, int16_t *qp) {
    int shift = 14 - ilogbf(top);
    if (ldexpf(top, shift) > INT16_STEPS) --shift;
    float scaled[BLOCK];
    for (int j = 0; j < BLOCK; ++j) scaled[j] = ldexpf(xp[j], shift);
    block_to_int16(scaled, 1.0f, qp);
    return ldexpf(1.0f, -shift);
}

static int prepare(const float *x, int rows, int k, int gated, const float *gamma, float eps,
                   prepared_x *p) {
    const int groups = k / BLOCK, padded = (groups + 7) & ~7;
    const size_t fx = sizeof(float) * (size_t)rows * k, fs = sizeof(float) * (size_t)rows * padded;
    const size_t need = fx + 2 * fs + sizeof(int16_t) * (size_t)rows * k;
    void *scratch = thread_buffer(SCRATCH_PREPARE, need);
    if (scratch == NULL) return -1;
    p->x = (float *)scratch;
    p->sum = (float *)((char *)scratch + fx);
    p->scale = (float *)((char *)scratch + fx + fs);
    p->q = (int16_t *)((char *)scratch + fx + 2 * fs);
    memset(p->sum, 0, 2 * fs); /* the padding reads as 0 */
    /* rows are independent: any thread computes a row the same way */
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; ++r) {
        input_row(x + (size_t)r * k * (gated ? 2 : 1), k, gated, gamma, eps,
                  p->x + (size_t)r * k);
        for (int g = 0; g < groups; ++g) {
            const size_t at = (size_t)r * padded + g;
            const float *xp = p->x + (size_t)r * k + (size_t)g * BLOCK;
            int16_t *qp = p->q + (size_t)r * k + (size_t)g * BLOCK;
            float s, top;
            block_sum_max(xp, &s, &top);
            if (!isfinite(s) || !isfinite(top)) { /* NaN/inf in x: the output is NaN */
                p->sum[at] = NAN;
                p->scale[at] = 0.0f;
                memset(qp, 0, sizeof(int16_t) * BLOCK);
                continue;
            }
            p->sum[at] = s;
            if (top > 0.0f && top < TINY_TOP) {
                p->scale[at] = tiny_block_to_int16(xp, top, qp);
                continue;
            }
            block_to_int16(xp, top > 0.0f ? INT16_STEPS / top : 0.0f, qp);
            p->scale[at] = top / INT16_STEPS;
        }
    }
    return 0;
}

#ifdef KVF_SIMD

/* 8 fp16 values from src as floats (the scale arrays are padded to a multiple of 8). */
static inline __m256 halves8(const uint8_t *src) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
}

/* A block's 32 weights as two vectors of 16 int16 (elements 0-15, then 16-31), the order of
 * x's int16 block: 4-bit byte j holds element j (low nibble) and j + 16 (high), so the
 * bytes widened to 16 bits give elements 0-15 by a mask and 16-31 by a shift; 8-bit codes
 * widen with their sign.
 * NOTE: measured on a 2-core AVX2 EPYC against the earlier unpacking (the 16 bytes in both
 * lanes, a variable shift and two masks, x kept as even then odd elements): 30 layers of
 * SmolLM2-135M's GEMVs at one row 3.85 -> 3.23 ms, 3072x576 51 -> 41 us. Four weight rows
 * share each pass over x, and the prefetch runs 8 rows ahead (was 2: 30 layers ~4% faster).
 * The prefetch walks the whole row 8 ahead in groups equal steps (ceil(row bytes / groups)),
 * so its scales and minimums are fetched too: they sit after the codes and are read first
 * (measured: B=1 engine step 9.46 -> 9.25 ms, interleaved in one process; B=8 level). */
/* Block g's share of weight row n + 8: the row in groups equal steps, codes then scales. */
static inline void prefetch_ahead(const uint8_t *w, size_t row_bytes, int n, int g, int groups) {
    const size_t step = (row_bytes + groups - 1) / groups;
    _mm_prefetch((const char *)(w + (size_t)(n + 8) * row_bytes + (size_t)g * step), _MM_HINT_T0);
}

static inline void unpack_q4(const uint8_t *at, __m256i *lo, __m256i *hi) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)at));
    *lo = _mm256_and_si256(w, _mm256_set1_epi16(0x000f));
    *hi = _mm256_srli_epi16(w, 4);
}

static inline void unpack_q8(const uint8_t *at, __m256i *lo, __m256i *hi) {
    *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)at));
    *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(at + 16)));
}

/* A block's dot product as 8 int32 partial sums: lo . xa + hi . xb by pairs of int16 (exact:
 * |x| <= INT16_STEPS, |w| <= 128). With VNNI the second product adds in the same instruction. */
static inline __m256i block_dot(__m256i lo, __m256i xa, __m256i hi, __m256i xb) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(lo, xa), hi, xb);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(lo, xa), hi, xb);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(lo, xa), _mm256_madd_epi16(hi, xb));
#endif
}

/* 8 of a row's block scales (or minimums) as floats: fp16, or float32 in a wide layout. */
static inline __m256 scale8(const uint8_t *src, int g0, int wide) {
    return wide ? _mm256_loadu_ps((const float *)(const void *)src + g0) : halves8(src + 2 * g0);
}

static inline void scales8(const uint8_t *dh, const float *xs, int groups, float *step, int wide) {
    for (int g0 = 0; g0 < groups; g0 += 8)
        _mm256_storeu_ps(step + g0, _mm256_mul_ps(scale8(dh, g0, wide), _mm256_loadu_ps(xs + g0)));
}

/* sum_g a[g] * b[g] for a row's fp16 (or wide: float32) a (padded to 8), as 8 partial sums. */
static inline __m256 dot8(const uint8_t *a16, const float *b, int groups, int wide) {
    __m256 acc = _mm256_setzero_ps();
    for (int g0 = 0; g0 < groups; g0 += 8)
        acc = _mm256_fmadd_ps(scale8(a16, g0, wide), _mm256_loadu_ps(b + g0), acc);
    return acc;
}

/* W weight rows (n .. n + W - 1) together: they share each x load and keep W independent
 * accumulator chains in flight. */
static inline __attribute__((always_inline)) void rows_q4(
    const prepared_x *p, int r_begin, int rows, int k, int groups, const uint8_t *w, size_t row_bytes,
    float *out, int n, int n_total, const int W, const int wide) {
    const int padded = (groups + 7) & ~7;
    float (*step)[MAX_GROUPS] = (float (*)[MAX_GROUPS])thread_steps();
    for (int r = r_begin; r < rows; ++r) {
        const float *xs = p->scale + (size_t)r * padded, *xsum = p->sum + (size_t)r * padded;
        const int16_t *xq = p->q + (size_t)r * k;
        __m256 acc[4], macc[4];
        for (int i = 0; i < W; ++i) {
            const uint8_t *dh = w + (size_t)(n + i) * row_bytes + (size_t)groups * 16;
            scales8(dh, xs, groups, step[i], wide);
            /* minimums times the exact x sums */
            macc[i] = dot8(dh + (wide ? 4 : 2) * padded, xsum, groups, wide);
            acc[i] = _mm256_setzero_ps();
        }
        for (int g = 0; g < groups; ++g) {
            const int16_t *xp = xq + (size_t)g * BLOCK;
            const __m256i xa = _mm256_loadu_si256((const __m256i *)xp);
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xp + 16));
            for (int i = 0; i < W; ++i) {
                const uint8_t *nib = w + (size_t)(n + i) * row_bytes + (size_t)g * 16;
                prefetch_ahead(w, row_bytes, n + i, g, groups);
                __m256i lo, hi;
                unpack_q4(nib, &lo, &hi);
                const __m256i s = block_dot(lo, xa, hi, xb);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(step[i] + g),
                                         acc[i]);
            }
        }
        for (int i = 0; i < W; ++i)
            store(p, out + (size_t)r * n_total + n + i, hsum8(_mm256_add_ps(acc[i], macc[i])));
    }
}

/* Q8_0 rows: the same without minimums. A NaN/inf block of x has step 0 and sum NaN, and
 * 0 * NaN carries the NaN into the row's output as float math would. Wide (Q6_K): each
 * block's two halves take their own scale (steps step[i] and step[4 + i]). */
static inline __attribute__((always_inline)) void rows_q8(
    const prepared_x *p, int r_begin, int rows, int k, int groups, const uint8_t *w, size_t row_bytes,
    float *out, int n, int n_total, const int W, const int wide) {
    const int padded = (groups + 7) & ~7;
    float (*step)[MAX_GROUPS] = (float (*)[MAX_GROUPS])thread_steps();
    for (int r = r_begin; r < rows; ++r) {
        const float *xs = p->scale + (size_t)r * padded, *xsum = p->sum + (size_t)r * padded;
        const int16_t *xq = p->q + (size_t)r * k;
        __m256 acc[4], nan_carry = _mm256_setzero_ps();
        for (int g0 = 0; g0 < groups; g0 += 8)
            nan_carry = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_loadu_ps(xsum + g0), nan_carry);
        for (int i = 0; i < W; ++i) {
            const uint8_t *dh = w + (size_t)(n + i) * row_bytes + (size_t)groups * BLOCK;
            scales8(dh, xs, groups, step[i], wide);
            if (wide) scales8(dh + 4 * (size_t)padded, xs, groups, step[4 + i], 1);
            acc[i] = _mm256_setzero_ps();
        }
        for (int g = 0; g < groups; ++g) {
            const int16_t *xp = xq + (size_t)g * BLOCK;
            const __m256i xa = _mm256_loadu_si256((const __m256i *)xp);
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xp + 16));
            for (int i = 0; i < W; ++i) {
                const uint8_t *at = w + (size_t)(n + i) * row_bytes + (size_t)g * BLOCK;
                prefetch_ahead(w, row_bytes, n + i, g, groups);
                __m256i lo, hi;
                unpack_q8(at, &lo, &hi);
                if (wide) {
                    const __m256i sa = _mm256_madd_epi16(lo, xa), sb = _mm256_madd_epi16(hi, xb);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa),
                                             _mm256_broadcast_ss(step[i] + g), acc[i]);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb),
                                             _mm256_broadcast_ss(step[4 + i] + g), acc[i]);
                    continue;
                }
                const __m256i s = block_dot(lo, xa, hi, xb);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(step[i] + g),
                                         acc[i]);
            }
        }
        for (int i = 0; i < W; ++i)
            store(p, out + (size_t)r * n_total + n + i, hsum8(_mm256_add_ps(acc[i], nan_carry)));
    }
}

/* For batches (prefill chunks, several decode rows) one pass over a pair of weight rows
 * serves TILE rows of x: the tile's rows share the weights' unpacking.
 * NOTE: measured on a 2-core AVX2 EPYC, 3072x576, best of 7: M=8 507 -> 362 us, M=16
 * 1,014 -> 755, M=32 1,949 -> 1,586 against the per-row loop (rows_q4), which stays for single rows: as a tile of one it ran
 * ~10% slower (GCC kept the tile's accumulators on the stack). */
#define TILE 4

/* Rows r0 .. r0 + TILE - 1 of x against weight rows n .. n + W - 1, 4-bit or (q8) 8-bit.
 * For 8-bit rows a NaN/inf block of x has step 0 and sum NaN, and 0 * NaN carries the NaN
 * into the row's output as float math would (4-bit rows carry it through the minimums). */
static inline __attribute__((always_inline)) void tile(
    const prepared_x *p, int r0, int k, int groups, const uint8_t *w, size_t row_bytes,
    float *out, int n, int n_total, const int W, const int q8) {
    const int padded = (groups + 7) & ~7;
    const size_t scales_at = (size_t)groups * (q8 ? BLOCK : 16);
    /* weight scale times x step, per weight row, x row, block */
    float (*step)[TILE][MAX_GROUPS] = (float (*)[TILE][MAX_GROUPS])thread_steps();
    _Pragma("GCC unroll 8")
    for (int i = 0; i < W; ++i)
        _Pragma("GCC unroll 8")
        for (int r = 0; r < TILE; ++r)
            scales8(w + (size_t)(n + i) * row_bytes + scales_at,
                    p->scale + (size_t)(r0 + r) * padded, groups, step[i][r], 0);
    __m256 acc[2][TILE];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < W; ++i)
        _Pragma("GCC unroll 8")
        for (int r = 0; r < TILE; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m256i lo[2], hi[2];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < W; ++i) {
            const uint8_t *at = w + (size_t)(n + i) * row_bytes + (size_t)g * (q8 ? BLOCK : 16);
            prefetch_ahead(w, row_bytes, n + i, g, groups);
            if (q8) unpack_q8(at, &lo[i], &hi[i]);
            else unpack_q4(at, &lo[i], &hi[i]);
        }
        _Pragma("GCC unroll 8")
        for (int r = 0; r < TILE; ++r) {
            const int16_t *xp = p->q + (size_t)(r0 + r) * k + (size_t)g * BLOCK;
            const __m256i xa = _mm256_loadu_si256((const __m256i *)xp);
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xp + 16));
            _Pragma("GCC unroll 8")
            for (int i = 0; i < W; ++i) {
                const __m256i s = block_dot(lo[i], xa, hi[i], xb);
                acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                            _mm256_broadcast_ss(step[i][r] + g), acc[i][r]);
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < W; ++i) {
        const uint8_t *mh = w + (size_t)(n + i) * row_bytes + scales_at + 2 * padded;
        _Pragma("GCC unroll 8")
        for (int r = 0; r < TILE; ++r) { /* 4-bit: minimums times the exact x sums */
            const float *xsum = p->sum + (size_t)(r0 + r) * padded;
            __m256 extra = _mm256_setzero_ps();
            if (q8)
                for (int g0 = 0; g0 < groups; g0 += 8)
                    extra = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_loadu_ps(xsum + g0), extra);
            else
                extra = dot8(mh, xsum, groups, 0);
            store(p, out + (size_t)(r0 + r) * n_total + n + i, hsum8(_mm256_add_ps(acc[i][r], extra)));
        }
    }
}

/* Weight rows of at most this many blocks go through the one-row loops one weight row at a
 * time (W = 1) rather than four together: the same arithmetic per output, so the same bits.
 * NOTE: measured on a 2-core EPYC with AVX-512 (the AVX2 build, KVFENCE_KERNEL_ISA=avx2), one
 * input row, random weights, 2 threads: Q8_0 262144x640 (Gemma 3's head) 11.5 against 18.8
 * ms, 49152x576 2.8 against 3.8; Q4_1 262144x640 5.6 against 11.7, 49152x576 0.93 against
 * 1.45-2.0; at 2048 columns mixed (Q8_0 0.54 against 0.72 ms, Q4_1 0.55 against 0.50), and
 * at 10240 four together win (Q8_0 9.0 against 11.5 ms, Q4_1 7.7 against 9.7). Four short
 * rows read at once cost more than their shared input loads save. Building with
 * -DROW_ALONE_GROUPS=0 (KVFENCE_KERNEL_CFLAGS) restores four together, for measuring. */
#ifndef ROW_ALONE_GROUPS
#define ROW_ALONE_GROUPS 48
#endif

/* Output rows n .. n + count - 1 of the weights at w (8-bit with q8) for every row of x:
 * whole tiles of TILE rows, then the rest one row at a time (the faster loop for one). Wide
 * weights (K-quants) run every row on the one-row loops. */
static void row_blocks(const prepared_x *p, int rows, int k, int groups, const uint8_t *w,
                       size_t row_bytes, float *out, int n, int n_total, int count, int q8,
                       int wide) {
    const int alone = groups <= ROW_ALONE_GROUPS;
    if (wide && alone) {
        for (int e = 0; e < count; ++e) {
            if (q8) rows_q8(p, 0, rows, k, groups, w, row_bytes, out, n + e, n_total, 1, 1);
            else rows_q4(p, 0, rows, k, groups, w, row_bytes, out, n + e, n_total, 1, 1);
        }
        return;
    }
    if (wide) {
        switch (count * 2 + q8) {
        case 8: rows_q4(p, 0, rows, k, groups, w, row_bytes, out, n, n_total, 4, 1); break;
        case 9: rows_q8(p, 0, rows, k, groups, w, row_bytes, out, n, n_total, 4, 1); break;
        case 6: rows_q4(p, 0, rows, k, groups, w, row_bytes, out, n, n_total, 3, 1); break;
        case 7: rows_q8(p, 0, rows, k, groups, w, row_bytes, out, n, n_total, 3, 1); break;
        case 4: rows_q4(p, 0, rows, k, groups, w, row_bytes, out, n, n_total, 2, 1); break;
        case 5: rows_q8(p, 0, rows, k, groups, w, row_bytes, out, n, n_total, 2, 1); break;
        case 3: rows_q8(p, 0, rows, k, groups, w, row_bytes, out, n, n_total, 1, 1); break;
        default: rows_q4(p, 0, rows, k, groups, w, row_bytes, out, n, n_total, 1, 1); break;
        }
        return;
    }
    int r0 = 0;
    for (; r0 + TILE <= rows; r0 += TILE) {
        for (int j = 0; j < count; j += 2) {
            const int pair = j + 1 < count;
            if (q8 && pair) tile(p, r0, k, groups, w, row_bytes, out, n + j, n_total, 2, 1);
            else if (q8) tile(p, r0, k, groups, w, row_bytes, out, n + j, n_total, 1, 1);
            else if (pair) tile(p, r0, k, groups, w, row_bytes, out, n + j, n_total, 2, 0);
            else tile(p, r0, k, groups, w, row_bytes, out, n + j, n_total, 1, 0);
        }
    }
    if (r0 == rows) return;
    if (alone) {
        for (int e = 0; e < count; ++e) {
            if (q8) rows_q8(p, r0, rows, k, groups, w, row_bytes, out, n + e, n_total, 1, 0);
            else rows_q4(p, r0, rows, k, groups, w, row_bytes, out, n + e, n_total, 1, 0);
        }
        return;
    }
    switch (count * 2 + q8) {
    case 8: rows_q4(p, r0, rows, k, groups, w, row_bytes, out, n, n_total, 4, 0); break;
    case 9: rows_q8(p, r0, rows, k, groups, w, row_bytes, out, n, n_total, 4, 0); break;
    case 6: rows_q4(p, r0, rows, k, groups, w, row_bytes, out, n, n_total, 3, 0); break;
    case 7: rows_q8(p, r0, rows, k, groups, w, row_bytes, out, n, n_total, 3, 0); break;
    case 4: rows_q4(p, r0, rows, k, groups, w, row_bytes, out, n, n_total, 2, 0); break;
    case 5: rows_q8(p, r0, rows, k, groups, w, row_bytes, out, n, n_total, 2, 0); break;
    case 3: rows_q8(p, r0, rows, k, groups, w, row_bytes, out, n, n_total, 1, 0); break;
    default: rows_q4(p, r0, rows, k, groups, w, row_bytes, out, n, n_total, 1, 0); break;
    }
}
#else

/* A row's block scale (or minimum) g: fp16, or float32 in a wide layout. */
static inline float scale_at(const uint8_t *src, int g, int wide) {
    float f;
    if (!wide) return half_at(src + 2 * (size_t)g);
    memcpy(&f, src + 4 * (size_t)g, 4);
    return f;
}

static void row_q4(const prepared_x *p, int rows, int k, int groups, const uint8_t *wrow,
                   float *out, int n, int n_total, int wide) {
    const float *x = p->x;
    const uint8_t *nib = wrow, *dh = wrow + (size_t)groups * 16;
    const uint8_t *mh = dh + (size_t)((groups + 7) & ~7) * (wide ? 4 : 2);
    for (int r = 0; r < rows; ++r) {
        const float *xr = x + (size_t)r * k;
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) {
            const uint8_t *blk = nib + (size_t)g * 16;
            const float *xp = xr + (size_t)g * BLOCK;
            float dot = 0.0f;
            for (int j = 0; j < 16; ++j) {
                dot += (float)(blk[j] & 0x0f) * xp[j];
                dot += (float)(blk[j] >> 4) * xp[j + 16];
            }
            total += scale_at(dh, g, wide) * dot +
                     scale_at(mh, g, wide) * p->sum[(size_t)r * ((groups + 7) & ~7) + g];
        }
        store(p, out + (size_t)r * n_total + n, total);
    }
}

static void row_q8(const prepared_x *p, int rows, int k, int groups, const uint8_t *wrow,
                   float *out, int n, int n_total, int wide) {
    const uint8_t *qs = wrow, *dh = wrow + (size_t)groups * BLOCK;
    const uint8_t *dh2 = dh + (size_t)((groups + 7) & ~7) * 4; /* wide: codes 16-31's scales */
    const float *x = p->x;
    for (int r = 0; r < rows; ++r) {
        const float *xr = x + (size_t)r * k;
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) {
            const uint8_t *b = qs + (size_t)g * BLOCK;
            const float *xp = xr + (size_t)g * BLOCK;
            float dot = 0.0f, dot2 = 0.0f;
            if (wide) {
                for (int j = 0; j < 16; ++j) dot += (float)(int8_t)b[j] * xp[j];
                for (int j = 16; j < BLOCK; ++j) dot2 += (float)(int8_t)b[j] * xp[j];
                total += scale_at(dh, g, 1) * dot + scale_at(dh2, g, 1) * dot2;
                continue;
            }
            for (int j = 0; j < BLOCK; ++j) dot += (float)(int8_t)b[j] * xp[j];
            total += half_at(dh + 2 * g) * dot;
        }
        store(p, out + (size_t)r * n_total + n, total);
    }
}
#endif

#if defined(KVF_SIMD) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__AVX512F__)
/* Batches of several rows on CPUs with AMX: each 16-row panel of weights is unpacked block by
 * block to bf16 (w = d * q + m rounded to bf16, as the dense bf16 copy holds it) and
 * multiplied on the tile unit with x rounded to bf16, accumulating in float32: the dense bf16
 * path's arithmetic, reading the 4-bit blocks instead of ~2.5x their bytes of bf16 weights,
 * and taking float32 in and out (no casts around the call).
 * A: weight tile (16 weight rows x 32 bf16 of one block); B: x's block as 16 pairs of k x 16
 * rows of x (the tile unit's pair-interleaved layout); C: 16 weight rows x 16 x rows, float32.
 * Tiles: A in tmm0, B in tmm1, up to AMX_M_TILES accumulators from tmm2. */
#include <sys/syscall.h>
#include <unistd.h>
#define KVF_AMX 1
#define AMX_M_TILES 6 /* 96 rows of x a pass over the weights */

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* 1: the process may use the tile data (asked for once), -1: refused, 0: not asked yet. */
static int amx_state = 0;
/* Batches of at least this many rows take the tile path, where the caller allows it. */
#define AMX_MIN_ROWS 5

static int amx_permitted(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) { /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (Linux >= 5.16) */
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

static void amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* x's blocks in B layout: [x tile][block][pair j][row i][2] bf16, x's row 16 t + i, elements
 * 2j and 2j + 1 of the block; rows past ``rows`` are 0. */

static uint16_t *amx_prepare(const float *x, int rows, int k, int gated, const float *gamma,
                             float eps, int tiles) {
    const int groups = k / BLOCK;
    const size_t xb_bytes = (size_t)tiles * groups * 1024, need = xb_bytes + sizeof(float) * k;
    void *amx_scratch = thread_buffer(SCRATCH_AMX, need);
    if (amx_scratch == NULL) return NULL;
    uint16_t *xb = (uint16_t *)amx_scratch;
    float *v = (float *)((char *)amx_scratch + xb_bytes);
    if (rows % 16) memset((char *)xb + (size_t)(tiles - 1) * groups * 1024, 0, (size_t)groups * 1024);
    const __m512i pairs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                               11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(16));
    for (int r = 0; r < rows; ++r) {
        input_row(x + (size_t)r * k * (gated ? 2 : 1), k, gated, gamma, eps, v);
        uint32_t *base = (uint32_t *)xb + (size_t)(r / 16) * groups * 256 + (r % 16);
        for (int g = 0; g < groups; ++g) {
            const __m512 lo = _mm512_loadu_ps(v + g * BLOCK), hi = _mm512_loadu_ps(v + g * BLOCK + 16);
            const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            _mm512_i32scatter_epi32(base + (size_t)g * 256, pairs, b, 4);
        }
    }
    return xb;
}

/* Weight row ``row``'s block g as 32 bf16 at dst (4-bit: w = d * q + m; q8: w = d * q). */
static inline void amx_unpack(const uint8_t *row, int g, int groups, int q8, uint16_t *dst) {
    const int padded = (groups + 7) & ~7;
    __m512 lo, hi;
    uint16_t dh;
    if (q8) {
        memcpy(&dh, row + (size_t)groups * BLOCK + 2 * g, 2);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
        const __m128i *at = (const __m128i *)(row + (size_t)g * BLOCK);
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at))), d);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at + 1))), d);
    } else {
        uint16_t mh;
        memcpy(&dh, row + (size_t)groups * 16 + 2 * g, 2);
        memcpy(&mh, row + (size_t)groups * 16 + 2 * (size_t)padded + 2 * g, 2);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh)), m = _mm512_set1_ps(_cvtsh_ss(mh));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + (size_t)g * 16)));
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), d, m);
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d, m);
    }
    _mm512_store_si512((__m512i *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* OP(t, tile) for the pass's x tiles t < mt, their accumulators in tmm2 + t (the tile
 * intrinsics take the register number as a literal). */
#define AMX_ZERO(t, tile) _tile_zero(tile)
#define AMX_DOT(t, tile)                                                                   \
    do {                                                                                   \
        _tile_loadd(1, xb + ((size_t)(m0 + (t)) * groups + g) * 512, 64);                   \
        _tile_dpbf16ps(tile, 0, 1);                                                        \
    } while (0)
#define AMX_STORE(t, tile) _tile_stored(tile, c[t], 64)
#define AMX_ALL(OP)                                                                        \
    switch (mt) {                                                                          \
    case 6: OP(5, 7); /* fall through */                                                   \
    case 5: OP(4, 6); /* fall through */                                                   \
    case 4: OP(3, 5); /* fall through */                                                   \
    case 3: OP(2, 4); /* fall through */                                                   \
    case 2: OP(1, 3); /* fall through */                                                   \
    default: OP(0, 2);                                                                     \
    }

/* out rows of weight rows n0 .. n0 + count - 1 (count <= 16) for every row of x. */
static void amx_panel(const uint8_t *w, size_t row_bytes, int groups, int q8, int n0, int count,
                      const uint16_t *xb, int rows, int tiles, float *out, int n_total,
                      int accumulate) {
    _Alignas(64) uint16_t a[16 * 32];
    _Alignas(64) float c[AMX_M_TILES][16 * 16];
    if (count < 16) memset(a, 0, sizeof a); /* rows past the weights stay 0 */
    for (int m0 = 0; m0 < tiles; m0 += AMX_M_TILES) {
        const int mt = tiles - m0 < AMX_M_TILES ? tiles - m0 : AMX_M_TILES;
        AMX_ALL(AMX_ZERO);
        for (int g = 0; g < groups; ++g) {
            for (int i = 0; i < count; ++i)
                amx_unpack(w + (size_t)(n0 + i) * row_bytes, g, groups, q8, a + 32 * i);
            _tile_loadd(0, a, 64);
            AMX_ALL(AMX_DOT);
        }
        AMX_ALL(AMX_STORE);
        for (int t = 0; t < mt; ++t)
            for (int j = 0; j < 16 && (m0 + t) * 16 + j < rows; ++j) {
                float *dst = out + (size_t)((m0 + t) * 16 + j) * n_total + n0;
                for (int i = 0; i < count; ++i)
                    dst[i] = accumulate ? dst[i] + c[t][16 * i + j] : c[t][16 * i + j];
            }
    }
}

/* out [rows, n_total] (= or += with accumulate) = input @ w.T through the tile unit; the
 * input as kvf_gemv takes it. Returns 0, or -1 when it does not run (nothing written). */
static int amx_gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out,
                    int q8, int gated, const float *gamma, float eps, int accumulate,
                    size_t row_bytes) {
    if (rows < AMX_MIN_ROWS || !amx_permitted()) return -1;
    const int groups = k / BLOCK, tiles = (rows + 15) / 16, panels = (n_total + 15) / 16;
    const uint16_t *xb = amx_prepare(x, rows, k, gated, gamma, eps, tiles);
    if (xb == NULL) return -1;
#pragma omp parallel if ((size_t)n_total * groups >= 2048)
    {
        amx_configure();
#pragma omp for schedule(static)
        for (int p = 0; p < panels; ++p) {
            const int n0 = 16 * p, count = n_total - n0 < 16 ? n_total - n0 : 16;
            amx_panel(w, row_bytes, groups, q8, n0, count, xb, rows, tiles, out, n_total,
                      accumulate);
        }
        _tile_release();
    }
    return 0;
}
#endif

/* ---- Panels: the batch-invariant layout and its kernels ----
 * Weights packed for batch-invariant steps (KVF_PANELS in a weight's q8 argument): output
 * rows in panels of PANEL, and each panel's block g as panel_bytes(q8) bytes at
 * w + ((size_t)panel * G + g) * panel_bytes(q8):
 *   4-bit: 256 bytes of codes [i 0..3][n 0..15][j 0..3]: the low nibble is q of element
 *       4i + j of output n, the high nibble element 16 + 4i + j (ggml's byte 4i + j);
 *   8-bit (q8): 512 bytes of int8 codes [i 0..7][n 0..15][j 0..3], element 4i + j;
 *   then 16 fp16 scales d, then 16 fp16 minimums m (output n at n; 0 for 8-bit blocks, so
 *   their mac only carries a NaN or inf of x, as float math would).
 * A row's output n is defined as (x's int16 blocks q_g, steps s_g and float sums t_g as
 * prepare() makes them, one row at a time):
 *   S_g = sum_e code_e * q_g[e]             exact int32; (float)S_g below is exact for
 *                                           4-bit codes (|S_g| < 2^24), rounded for 8-bit
 *   acc = fmaf((float)S_g, d_g * s_g, acc)  for g = 0 .. G-1, from 0
 *   mac = fmaf(m_g, t_g, mac)               for g = 0 .. G-1, from 0
 *   out = acc + mac                         (out + that, for a residual add)
 * Every path below (plain C; AVX512-VNNI, one row or four) computes exactly this: integer
 * sums are exact in any order and the float steps are one chain per output in block
 * order, so a row's output is the same bits in a batch of any size, at any place in it.
 * NOTE: why not the int16 GEMV's arithmetic: it keeps 8 float partial sums per block (one
 * per vpmaddwd lane), so a batch kernel reproducing it does 8 conversions and FMAs per
 * (row, output, block) on top of the integer products; with one exact integer per block
 * the float work is one FMA per (row, output, block), 16 outputs a vector. */
#define PANEL 16

static inline size_t panel_bytes(int q8) { return q8 ? 576 : 320; }

/* Output rows n0 .. n0 + PANEL - 1 (the panel at ``panel``) for rows r_begin .. r_end - 1
 * of x, in plain C. */
static __attribute__((unused)) void panel_plain(const prepared_x *p, int r_begin, int r_end,
                                                int k, int groups, const uint8_t *panel,
                                                float *out, int n0, int n_total, int q8) {
    const size_t step_bytes = panel_bytes(q8), d_at = q8 ? 512 : 256;
    const int padded = (groups + 7) & ~7;
    for (int r = r_begin; r < r_end; ++r) {
        const int16_t *q = p->q + (size_t)r * k;
        const float *xs = p->scale + (size_t)r * padded, *xsum = p->sum + (size_t)r * padded;
        float acc[PANEL], mac[PANEL];
        for (int n = 0; n < PANEL; ++n) acc[n] = mac[n] = 0.0f;
        for (int g = 0; g < groups; ++g) {
            const uint8_t *b = panel + (size_t)g * step_bytes;
            const int16_t *qg = q + (size_t)g * BLOCK;
            for (int n = 0; n < PANEL; ++n) {
                int32_t s = 0;
                for (int i = 0; i < (q8 ? 8 : 4); ++i)
                    for (int j = 0; j < 4; ++j) {
                        const int c = b[64 * i + 4 * n + j];
                        if (q8) s += (int8_t)c * qg[4 * i + j];
                        else s += (c & 15) * qg[4 * i + j] + (c >> 4) * qg[16 + 4 * i + j];
                    }
                const float step = half_at(b + d_at + 2 * n) * xs[g];
                acc[n] = fmaf((float)s, step, acc[n]);
                mac[n] = fmaf(half_at(b + d_at + 32 + 2 * n), xsum[g], mac[n]);
            }
        }
        for (int n = 0; n < PANEL; ++n) store(p, out + (size_t)r * n_total + n0 + n, acc[n] + mac[n]);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVF_PANEL_SIMD 1

/* x's int16 blocks as bytes for the byte dot products: q = 256 * hi + lo, hi signed, lo
 * unsigned; hi at xb, lo at xb + plane, each plane [rows, k] and then zeros to ``plane``
 * bytes (the tile unit reads whole tiles of 16 rows); then each block's sum of hi as int32
 * [rows, groups] (vpdpbusd multiplies unsigned by signed bytes: 8-bit codes c take
 * (c + 128) . hi - 128 * sum(hi)). */
static void panel_split(const prepared_x *p, int rows, int k, uint8_t *xb, size_t plane) {
    const int groups = k / BLOCK;
    const size_t total = (size_t)rows * k;
    int32_t *hsum = (int32_t *)(xb + 2 * plane);
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; ++r) {
        const int16_t *q = p->q + (size_t)r * k;
        uint8_t *hi = xb + (size_t)r * k, *lo = xb + plane + (size_t)r * k;
        for (int e = 0; e < k; ++e) {
            lo[e] = (uint8_t)(q[e] & 0xff);
            hi[e] = (uint8_t)(int8_t)(q[e] >> 8); /* (q - lo) / 256, exact */
        }
        for (int g = 0; g < groups; ++g) {
            int32_t h = 0;
            for (int j = 0; j < BLOCK; ++j) h += (int8_t)hi[g * BLOCK + j];
            hsum[(size_t)r * groups + g] = h;
        }
    }
    memset(xb + total, 0, plane - total);
    memset(xb + plane + total, 0, plane - total);
}

static inline __m512i bytes4(const uint8_t *at) {
    int32_t v;
    memcpy(&v, at, 4);
    return _mm512_set1_epi32(v);
}

/* R (1-4) rows from r0 against one panel, 16 outputs a vector: each block's codes are
 * unpacked once for the R rows, and S_g = 256 * (codes . hi) + (codes . lo) by vpdpbusd
 * (unsigned times signed bytes: codes times hi, lo times codes), exact. */
static inline __attribute__((always_inline)) void panel_simd_rows(
    const prepared_x *p, const uint8_t *xb, size_t plane, int r0, const int R, int k, int groups,
    const uint8_t *panel, float *out, int n0, int n_total, const int q8) {
    const int padded = (groups + 7) & ~7;
    const size_t lo_at = plane, step_bytes = panel_bytes(q8), d_at = q8 ? 512 : 256;
    const int32_t *hsum = (const int32_t *)(xb + 2 * plane);
    const __m512i nibble = _mm512_set1_epi8(0x0f), bias = _mm512_set1_epi8((char)0x80);
    __m512 acc[4], mac[4];
    for (int r = 0; r < R; ++r) acc[r] = mac[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        const uint8_t *b = panel + (size_t)g * step_bytes;
        /* 4-bit: wl[i] elements 4i .. 4i + 3 of each output, wh[i] 16 + 4i ..; 8-bit:
         * wl[i] elements 4i .. as signed bytes, wh[i] the same plus 128 (unsigned) */
        __m512i wl[8], wh[8];
        for (int i = 0; i < (q8 ? 8 : 4); ++i) {
            const __m512i c = _mm512_loadu_si512((const void *)(b + 64 * i));
            if (q8) {
                wl[i] = c;
                wh[i] = _mm512_xor_si512(c, bias);
            } else {
                wl[i] = _mm512_and_si512(c, nibble);
                wh[i] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + d_at)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + d_at + 32)));
        for (int r = 0; r < R; ++r) {
            const size_t at = (size_t)(r0 + r) * k + (size_t)g * BLOCK;
            const uint8_t *hi = xb + at, *lo = xb + lo_at + at;
            __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
            if (q8) {
                for (int i = 0; i < 8; i += 2) {
                    h0 = _mm512_dpbusd_epi32(h0, wh[i], bytes4(hi + 4 * i));
                    h1 = _mm512_dpbusd_epi32(h1, wh[i + 1], bytes4(hi + 4 * i + 4));
                    l0 = _mm512_dpbusd_epi32(l0, bytes4(lo + 4 * i), wl[i]);
                    l1 = _mm512_dpbusd_epi32(l1, bytes4(lo + 4 * i + 4), wl[i + 1]);
                }
                const int32_t bias_sum = 128 * hsum[(size_t)(r0 + r) * groups + g];
                h0 = _mm512_sub_epi32(h0, _mm512_set1_epi32(bias_sum));
            } else for (int i = 0; i < 4; i += 2) {
                h0 = _mm512_dpbusd_epi32(h0, wl[i], bytes4(hi + 4 * i));
                h1 = _mm512_dpbusd_epi32(h1, wh[i], bytes4(hi + 16 + 4 * i));
                h0 = _mm512_dpbusd_epi32(h0, wl[i + 1], bytes4(hi + 4 * i + 4));
                h1 = _mm512_dpbusd_epi32(h1, wh[i + 1], bytes4(hi + 20 + 4 * i));
                l0 = _mm512_dpbusd_epi32(l0, bytes4(lo + 4 * i), wl[i]);
                l1 = _mm512_dpbusd_epi32(l1, bytes4(lo + 16 + 4 * i), wh[i]);
                l0 = _mm512_dpbusd_epi32(l0, bytes4(lo + 4 * i + 4), wl[i + 1]);
                l1 = _mm512_dpbusd_epi32(l1, bytes4(lo + 20 + 4 * i), wh[i + 1]);
            }
            const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8),
                                               _mm512_add_epi32(l0, l1));
            const float *xs = p->scale + (size_t)(r0 + r) * padded;
            const float *xsum = p->sum + (size_t)(r0 + r) * padded;
            const __m512 step = _mm512_mul_ps(d, _mm512_set1_ps(xs[g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), step, acc[r]);
            mac[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[g]), mac[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float *dst = out + (size_t)(r0 + r) * n_total + n0;
        __m512 v = _mm512_add_ps(acc[r], mac[r]);
        if (p->accumulate) v = _mm512_add_ps(_mm512_loadu_ps(dst), v);
        _mm512_storeu_ps(dst, v);
    }
}
#endif

/* This thread's share [lo, hi) of n items split in contiguous runs over the region's threads
 * (the whole of them outside a parallel region). */
static inline void thread_share(int n, int *lo, int *hi) {
    const int threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int each = n / threads, extra = n % threads;
    *lo = t * each + (t < extra ? t : extra);
    *hi = *lo + each + (t < extra);
}

#if defined(KVF_PANEL_SIMD) && defined(KVF_AMX) && defined(__AMX_INT8__)
/* Batches of PANEL_AMX_MIN_ROWS or more on the tile unit: per 16 rows of x, a panel and a
 * block, S_g of the 16 x 16 (row, output) pairs as two int8 tile products (codes times hi
 * bytes, lo bytes times codes), exact in int32, then the same float steps as
 * panel_simd_rows, row by row. Tiles: 0 and 1 x's hi and lo bytes of the block (16 rows x
 * 32), 2 the panel's codes of the block (8 x 64: row i holds elements 4i .. 4i + 3 of each
 * output), 3 and 4 the int32 sums of even blocks, 5 and 6 those of odd blocks. */
#define KVF_PANEL_AMX 1
#define PANEL_AMX_MIN_ROWS 16
/* Panels a thread unpacks together; each tile of 16 rows then meets them all in turn, its x
 * bytes (16 x k, twice) staying in the core's first-level cache across them.
 * NOTE: measured on the 2-core AMX Xeon, SmolLM2-135M's projections of one layer at 512 rows
 * (same bits): 10.8 ms a layer with one panel at a time (each panel swept every tile's x
 * from the second-level cache), 9.3 with 4, 8.0 with 16, 7.9 with 32 or 64. */
#define PANEL_CHUNK 16

static void panel_amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; ++t) {
        c.rows[t] = t == 2 ? 8 : 16;
        c.colsb[t] = t < 2 ? 32 : 64;
    }
    _tile_loadconfig(&c);
}

/* A panel's codes in the tile layout, 512 bytes a block, at wb (4-bit codes unpacked to
 * bytes; 8-bit panels hold them so already and leave wb alone), and its scales d and
 * minimums m as floats at dm, 32 a block (d of the 16 outputs, then m). */
static void panel_unpack(const uint8_t *panel, int groups, int q8, uint8_t *wb, float *dm) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const size_t step_bytes = panel_bytes(q8), d_at = q8 ? 512 : 256;
    for (int g = 0; g < groups; ++g) {
        const uint8_t *b = panel + (size_t)g * step_bytes;
        _mm512_store_ps(dm + 32 * (size_t)g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + d_at))));
        _mm512_store_ps(dm + 32 * (size_t)g + 16,
                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + d_at + 32))));
        if (q8) continue;
        for (int i = 0; i < 4; ++i) {
            const __m512i c = _mm512_loadu_si512((const void *)(b + 64 * i));
            _mm512_storeu_si512((void *)(wb + (size_t)g * 512 + 64 * i), _mm512_and_si512(c, nibble));
            _mm512_storeu_si512((void *)(wb + (size_t)g * 512 + 256 + 64 * i),
                                _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble));
        }
    }
}

/* Rows r0 .. r0 + live - 1 (live <= 16; xb's planes hold whole tiles) against one panel,
 * its codes in the tile layout at codes (block g at codes + g * stride) and its scales at dm
 * (panel_unpack); xst: the tile's 16 rows' activation scales a block (block g's at
 * xst + 16 g, zero past live). Software-pipelined: block g's tile products are issued before
 * block g - 1's sums leave the tile unit (the two blocks in different tiles), and the vector
 * units take those sums into acc, one register a row. mac, which needs no products, is a
 * second pass over the blocks, four rows' chains at a time. Both chains keep block order;
 * rows past live compute zeros and are not stored.
 * NOTE: measured as for PANEL_CHUNK, panels chunked: 8.0 ms a layer with acc in memory and
 * each block's sums stored right after its products, 7.6 as here. */
static void panel_amx_tile(const prepared_x *p, const uint8_t *xb, size_t plane, int r0, int live,
                           int k, int groups, const float *dm, const uint8_t *codes,
                           size_t stride, const float *xst, float *out, int n0, int n_total) {
    const int padded = (groups + 7) & ~7;
    _Alignas(64) int32_t sums[2][16 * 16]; /* [hi, lo][row x output] */
#define ACC(r) __m512 a##r = _mm512_setzero_ps();
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    ACC(8) ACC(9) ACC(10) ACC(11) ACC(12) ACC(13) ACC(14) ACC(15)
#undef ACC
    const uint8_t *xh = xb + (size_t)r0 * k, *xl = xb + plane + (size_t)r0 * k;
    for (int g = 0; g <= groups; ++g) {
        if (g < groups) {
            _tile_loadd(0, xh + (size_t)g * BLOCK, k);
            _tile_loadd(1, xl + (size_t)g * BLOCK, k);
            _tile_loadd(2, codes + (size_t)g * stride, 64);
            if (g & 1) {
                _tile_zero(5);
                _tile_zero(6);
                _tile_dpbssd(5, 0, 2);
                _tile_dpbusd(6, 1, 2);
            } else {
                _tile_zero(3);
                _tile_zero(4);
                _tile_dpbssd(3, 0, 2);
                _tile_dpbusd(4, 1, 2);
            }
        }
        if (g == 0) continue;
        const int h = g - 1;
        if (h & 1) {
            _tile_stored(5, sums[0], 64);
            _tile_stored(6, sums[1], 64);
        } else {
            _tile_stored(3, sums[0], 64);
            _tile_stored(4, sums[1], 64);
        }
        const __m512 d = _mm512_load_ps(dm + 32 * (size_t)h);
        const float *xs = xst + 16 * (size_t)h;
#define STEP(r)                                                                            \
    a##r = _mm512_fmadd_ps(                                                                \
        _mm512_cvtepi32_ps(_mm512_add_epi32(                                               \
            _mm512_slli_epi32(_mm512_load_si512(sums[0] + 16 * (r)), 8),                   \
            _mm512_load_si512(sums[1] + 16 * (r)))),                                       \
        _mm512_mul_ps(d, _mm512_set1_ps(xs[r])), a##r);
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
        STEP(8) STEP(9) STEP(10) STEP(11) STEP(12) STEP(13) STEP(14) STEP(15)
#undef STEP
    }
    const __m512 acc[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
    for (int r = 0; r < live; r += 4) {
        const float *t[4]; /* rows past live repeat row r; their results are dropped */
        for (int i = 0; i < 4; ++i)
            t[i] = p->sum + (size_t)(r0 + r + (r + i < live ? i : 0)) * padded;
        __m512 mac0 = _mm512_setzero_ps(), mac1 = mac0, mac2 = mac0, mac3 = mac0;
        for (int g = 0; g < groups; ++g) {
            const __m512 m = _mm512_load_ps(dm + 32 * (size_t)g + 16);
            mac0 = _mm512_fmadd_ps(m, _mm512_set1_ps(t[0][g]), mac0);
            mac1 = _mm512_fmadd_ps(m, _mm512_set1_ps(t[1][g]), mac1);
            mac2 = _mm512_fmadd_ps(m, _mm512_set1_ps(t[2][g]), mac2);
            mac3 = _mm512_fmadd_ps(m, _mm512_set1_ps(t[3][g]), mac3);
        }
        const __m512 mac[4] = {mac0, mac1, mac2, mac3};
        for (int i = 0; i < 4 && r + i < live; ++i) {
            float *dst = out + (size_t)(r0 + r + i) * n_total + n0;
            __m512 v = _mm512_add_ps(acc[r + i], mac[i]);
            if (p->accumulate) v = _mm512_add_ps(_mm512_loadu_ps(dst), v);
            _mm512_storeu_ps(dst, v);
        }
    }
}

/* Panels lo .. hi - 1 (this thread's) for every row of x, PANEL_CHUNK panels at a time:
 * unpacked together (their codes at wb, scales at dm), then each tile of 16 rows against
 * each of them, its activation scales laid out by block at xst first. */
static void panel_chunks(const prepared_x *p, const uint8_t *xb, size_t plane, int rows, int k,
                         const uint8_t *w, int lo, int hi, int q8, float *dm, uint8_t *wb,
                         float *xst, float *out, int n_total) {
    const int groups = k / BLOCK, padded = (groups + 7) & ~7;
    const size_t bytes = (size_t)groups * panel_bytes(q8), unpacked = q8 ? 0 : (size_t)groups * 512;
    for (int c0 = lo; c0 < hi; c0 += PANEL_CHUNK) {
        const int c1 = c0 + PANEL_CHUNK < hi ? c0 + PANEL_CHUNK : hi;
        for (int q = c0; q < c1; ++q)
            panel_unpack(w + (size_t)q * bytes, groups, q8, wb + (size_t)(q - c0) * unpacked,
                         dm + (size_t)(q - c0) * 32 * groups);
        for (int r0 = 0; r0 < rows; r0 += 16) {
            const int live = rows - r0 < 16 ? rows - r0 : 16;
            for (int g = 0; g < groups; ++g)
                for (int r = 0; r < 16; ++r)
                    xst[16 * g + r] = r < live ? p->scale[(size_t)(r0 + r) * padded + g] : 0.0f;
            for (int q = c0; q < c1; ++q)
                panel_amx_tile(p, xb, plane, r0, live, k, groups, dm + (size_t)(q - c0) * 32 * groups,
                               q8 ? w + (size_t)q * bytes : wb + (size_t)(q - c0) * unpacked,
                               q8 ? panel_bytes(q8) : 512, xst, out, q * PANEL, n_total);
        }
    }
}
#endif

/* Whether the panel layout runs on SIMD here (else on panel_plain: the same bits, slowly). */
int kvf_panel_simd(void) {
#ifdef KVF_PANEL_SIMD
    return 1;
#else
    return 0;
#endif
}

/* Whether batches of the panel layout run on the tile unit here (the same bits). */
int kvf_panel_amx(void) {
#ifdef KVF_PANEL_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

#ifdef KVF_PANEL_SIMD
/* Rows r0 .. rows - 1 against one panel on AVX512-VNNI, four at a time. */
#define PANEL_ROWS(R, Q8) \
    panel_simd_rows(p, xb, plane, r, R, k, groups, panel, out, n0, n_total, Q8)
static void panel_simd_all(const prepared_x *p, const uint8_t *xb, size_t plane, int r0, int rows,
                           int k, int groups, const uint8_t *panel, float *out, int n0, int n_total,
                           int q8) {
    int r = r0;
    for (; r + 4 <= rows; r += 4) {
        if (q8) PANEL_ROWS(4, 1);
        else PANEL_ROWS(4, 0);
    }
    switch ((rows - r) * 2 + q8) {
    case 7: PANEL_ROWS(3, 1); break;
    case 6: PANEL_ROWS(3, 0); break;
    case 5: PANEL_ROWS(2, 1); break;
    case 4: PANEL_ROWS(2, 0); break;
    case 3: PANEL_ROWS(1, 1); break;
    case 2: PANEL_ROWS(1, 0); break;
    default: break;
    }
}
#undef PANEL_ROWS
#endif

/* A LoRA delta's planned work (lora_plan, below, gives its arithmetic). */
typedef struct lora_job lora_job;
struct lora_job {
    const float *in, *mask; /* in NULL: the base product's prepared input, once it has one */
    const void *a, *bt;
    const int *ends;
    float *out, *u, *spare; /* spare [rows, k]: the input made here where the base has none */
    int *span, *order, *starts;
    int rows, k, n, held, ranks, parts, groups, blocks;
    size_t work; /* multiply-adds */
};

static void lora_prefetch(const lora_job *job);
static void lora_products(const lora_job *job);
static int lora_parallel(const lora_job *job);

/* out [rows, n_total] (= or += with p->accumulate) for weights w in the panel layout, then,
 * with job (else NULL), out += its LoRA delta, both in one parallel region: the delta's
 * weights asked for first, its products after the panels.
 * Returns 0, or -1 without scratch memory (nothing written). */
static int panel_gemv(const prepared_x *p, int rows, int k, const uint8_t *w, int n_total,
                      float *out, int q8, const lora_job *job) {
    const int groups = k / BLOCK, panels = n_total / PANEL;
    const int parallel = (size_t)n_total * groups >= 2048 || (job != NULL && lora_parallel(job));
    const size_t bytes = panel_bytes(q8);
#ifdef KVF_PANEL_SIMD
    const size_t plane = (size_t)((rows + 15) & ~15) * k;
    uint8_t *xb = (uint8_t *)thread_buffer(SCRATCH_PANEL,
                                           2 * plane + sizeof(int32_t) * (size_t)rows * groups);
    if (xb == NULL) return -1;
    panel_split(p, rows, k, xb, plane);
#endif
#ifdef KVF_PANEL_AMX
    if (rows >= PANEL_AMX_MIN_ROWS && amx_permitted()) {
        int no_memory = 0;
#pragma omp parallel if (parallel) reduction(| : no_memory)
        {
            if (job != NULL) lora_prefetch(job);
            /* dm (floats, 64-byte aligned) first, then the unpacked 4-bit codes, then xst */
            const size_t unpacked = (size_t)PANEL_CHUNK * groups * (q8 ? 0 : 512);
            float *dm = (float *)thread_buffer(SCRATCH_PANEL_CODES,
                                               (size_t)PANEL_CHUNK * groups * 128 + unpacked +
                                                   sizeof(float) * 16 * (size_t)groups);
            uint8_t *wb = (uint8_t *)(dm + (size_t)PANEL_CHUNK * 32 * groups);
            no_memory = dm == NULL;
            panel_amx_configure();
            int lo, hi;
            thread_share(panels, &lo, &hi);
            if (!no_memory)
                panel_chunks(p, xb, plane, rows, k, w, lo, hi, q8, dm, wb,
                             (float *)(wb + unpacked), out, n_total);
            _tile_release();
            if (job != NULL) lora_products(job);
        }
        return no_memory ? -1 : 0;
    }
#endif
#pragma omp parallel if (parallel)
    {
        if (job != NULL) lora_prefetch(job);
#pragma omp for schedule(static) nowait
        for (int q = 0; q < panels; ++q) {
            const uint8_t *panel = w + (size_t)q * groups * bytes;
#ifdef KVF_PANEL_SIMD
            panel_simd_all(p, xb, plane, 0, rows, k, groups, panel, out, q * PANEL, n_total, q8);
#else
            panel_plain(p, 0, rows, k, groups, panel, out, q * PANEL, n_total, q8);
#endif
        }
        if (job != NULL) lora_products(job);
    }
    return 0;
}
/* ---- end of the panels ---- */

/* Whether batches can take the tile path (built for and allowed on this CPU). */
int kvf_amx(void) {
#ifdef KVF_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* The smallest batch that takes the tile path (0 where there is none). */
int kvf_amx_min_rows(void) {
#ifdef KVF_AMX
    return AMX_MIN_ROWS;
#else
    return 0;
#endif
}

int kvf_q4_simd(void) {
#ifdef KVF_SIMD
    return 1;
#else
    return 0;
#endif
}

int kvf_q4_max_k(void) { return MAX_GROUPS * BLOCK; }

/* RoPE on the first heads * dim columns of each row of out [rows, n_total] (the q and k
 * heads of a fused qkv projection): with c, s = table[r, 0], table[r, 1] ([rows, 2, dim]:
 * cos, and sin with its first half negated, as LlamaModel.rope holds them),
 * y[j] = x[j] * c[j] + x[j +- dim/2] * s[j] (rotate_half folded into the sign of s). */
static void rope_rows(float *out, int rows, int n_total, int heads, int dim, const float *table) {
    const int half = dim / 2;
    for (int r = 0; r < rows; ++r) {
        const float *c = table + (size_t)r * 2 * dim, *sn = c + dim;
        for (int h = 0; h < heads; ++h) {
            float *x = out + (size_t)r * n_total + (size_t)h * dim;
            for (int j = 0; j < half; ++j) {
                const float lo = x[j], hi = x[j + half];
                x[j] = lo * c[j] + hi * sn[j];
                x[j + half] = hi * c[j + half] + lo * sn[j + half];
            }
        }
    }
}

/* out [rows, n_total] = input @ w.T, float32, or with ``accumulate`` out += input @ w.T.
 * The input is x [rows, k] float32, or with ``gated`` x [rows, 2k] and
 * input = silu(x[:, :k]) * x[:, k:]; with ``gamma`` [k] (else NULL) the input is then
 * RMS-normalized (eps) and scaled by gamma. w [n_total, row bytes] (layout above). With
 * ``rope`` [rows, 2, rope_dim] (else NULL), rope_rows then rotates the first rope_heads
 * heads of each output row. Returns 0, or -1 when the shapes are outside what the kernel
 * takes (nothing written). */
static int gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out,
                int q8, int gated, const float *gamma, float eps, int accumulate,
                const float *rope, int rope_heads, int rope_dim, lora_job *job);

int kvf_gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out,
             int q8, int gated, const float *gamma, float eps, int accumulate,
             const float *rope, int rope_heads, int rope_dim) {
    return gemv(x, rows, k, w, n_total, out, q8, gated, gamma, eps, accumulate, rope, rope_heads,
                rope_dim, NULL);
}

static inline void lora_run(const lora_job *job);
static inline void lora_input(lora_job *job, const float *x, int gated, const float *gamma,
                              float eps);

/* kvf_gemv, then (job, else NULL) out += its LoRA delta before the rotation: in the
 * projection's own parallel region where the weights are in the panel layout. A job
 * without an input takes the product's (x after its gate and norm, as prepare makes it). */
static int gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out,
                int q8, int gated, const float *gamma, float eps, int accumulate,
                const float *rope, int rope_heads, int rope_dim, lora_job *job) {
    if (rows < 1 || rows > MAX_ROWS || k < BLOCK || k % BLOCK != 0 || k / BLOCK > MAX_GROUPS ||
        n_total < 1 || gated < GATE_NONE || gated >= GATE_KINDS)
        return -1;
    if (rope != NULL && (accumulate || rope_heads < 1 || rope_dim < 2 || rope_dim % 2 != 0 ||
                         (int64_t)rope_heads * rope_dim > n_total))
        return -1;
    const int may_tile = (q8 & KVF_TILES) != 0, panels = (q8 & KVF_PANELS) != 0;
    const int wide = (q8 & KVF_WIDE) != 0;
    q8 &= 1;
    if (panels && (n_total % PANEL != 0 || wide)) return -1;
    const int groups = k / BLOCK;
    const size_t padded = (size_t)((groups + 7) & ~7);
    const size_t row_bytes = wide ? (size_t)groups * (q8 ? 32 : 16) + 8 * padded
                             : q8 ? (size_t)groups * 32 + 2 * padded
                                  : (size_t)groups * 16 + 4 * padded;
    if (panels) {
        prepared_x p;
        if (prepare(x, rows, k, gated, gamma, eps, &p) != 0) return -1;
        p.accumulate = accumulate;
        if (job != NULL && job->in == NULL) job->in = p.x;
        if (panel_gemv(&p, rows, k, w, n_total, out, q8, job) != 0) return -1;
        if (rope != NULL) rope_rows(out, rows, n_total, rope_heads, rope_dim, rope);
        return 0;
    }
#ifdef KVF_AMX
    if (may_tile && !wide &&
        amx_gemv(x, rows, k, w, n_total, out, q8, gated, gamma, eps, accumulate, row_bytes) == 0) {
        if (job != NULL) {
            lora_input(job, x, gated, gamma, eps);
            lora_run(job);
        }
        if (rope != NULL) rope_rows(out, rows, n_total, rope_heads, rope_dim, rope);
        return 0;
    }
#else
    (void)may_tile;
#endif
    prepared_x p;
    if (prepare(x, rows, k, gated, gamma, eps, &p) != 0) return -1;
    p.accumulate = accumulate;
    if (job != NULL && job->in == NULL) job->in = p.x;
#ifdef KVF_SIMD
    const int quads = (n_total + 3) / 4;
    /* below ~2,000 blocks the threads' start-up costs more than they save */
    int no_memory = 0;
#pragma omp parallel if ((size_t)n_total * groups >= 2048 || (job != NULL && lora_parallel(job))) \
    reduction(| : no_memory)
    {
        if (job != NULL) lora_prefetch(job);
        /* each worker's weight-scale tables (thread_steps), on the heap */
        no_memory = thread_buffer(SCRATCH_STEPS, sizeof(float) * STEP_FLOATS) == NULL;
#pragma omp for schedule(static) nowait
        for (int i = 0; i < quads; ++i) {
            const int n = 4 * i, count = n_total - n < 4 ? n_total - n : 4;
            if (!no_memory)
                row_blocks(&p, rows, k, groups, w, row_bytes, out, n, n_total, count, q8, wide);
        }
        if (job != NULL) lora_products(job);
    }
    if (no_memory) return -1;
#else
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_total; ++n) {
        if (q8) row_q8(&p, rows, k, groups, w + (size_t)n * row_bytes, out, n, n_total, wide);
        else row_q4(&p, rows, k, groups, w + (size_t)n * row_bytes, out, n, n_total, wide);
    }
    if (job != NULL) lora_run(job);
#endif
    if (rope != NULL) rope_rows(out, rows, n_total, rope_heads, rope_dim, rope);
    return 0;
}

/* A decoder layer's work between its attention and the next layer's, in one call:
 *   x += attn @ o.T;  h = rms_norm(x, gamma, eps) @ gate_up.T;  x += (silu(h[:, :i]) * h[:, i:]) @ down.T
 * x [rows, hidden] (the residual stream, updated in place), attn [rows, q_size], h [rows, 2i]
 * scratch; o [hidden, q_size], gate_up [2i, hidden] and down [hidden, i] in the layout above
 * (each 8-bit with its q8 flag). The same arithmetic as the three kvf_gemv calls, one call.
 * Returns 0, or -1 when a shape is outside what the kernel takes (checked first: nothing
 * written), or when scratch memory for a product's input cannot be had (then x may hold
 * the products before it). */
static int mlp(float *x, const float *attn, float *h, int rows, int hidden, int q_size,
               int inter, const uint8_t *o, int o_q8, const float *gamma, float eps,
               const uint8_t *gate_up, int gate_up_q8, const uint8_t *down, int down_q8,
               const int64_t *block, int act, float *a, const int64_t *lo, const int64_t *lgu,
               const int64_t *ldown, float *v, float *u, int *span);

int kvf_mlp(float *x, const float *attn, float *h, int rows, int hidden, int q_size, int inter,
            const uint8_t *o, int o_q8, const float *gamma, float eps, const uint8_t *gate_up,
            int gate_up_q8, const uint8_t *down, int down_q8) {
    const int ks[3] = {q_size, hidden, inter};
    for (int i = 0; i < 3; ++i)
        if (ks[i] < BLOCK || ks[i] % BLOCK != 0 || ks[i] / BLOCK > MAX_GROUPS) return -1;
    if (rows < 1 || rows > MAX_ROWS || hidden < 1 || inter < 1 || gamma == NULL) return -1;
    return mlp(x, attn, h, rows, hidden, q_size, inter, o, o_q8, gamma, eps, gate_up, gate_up_q8,
               down, down_q8, NULL, GATE_SILU, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
}

/* kvcache's attention for one layer of an all-decode step (kvcache.attention.NativeAttend):
 * stores the layer's K/V at the step's rows and attends; 0, or -1 with nothing written. */
typedef int (*attend_fn)(const void *ctx, int layer, const float *q, const float *k,
                         const float *v, float *out);

/* Per layer, the columns of kvf_decoder_stack's table (int64 each: pointers and flags). */
enum { T_QKV, T_QKV_Q8, T_ATTN_NORM, T_O, T_O_Q8, T_MLP_NORM, T_GATE_UP, T_GATE_UP_Q8, T_DOWN,
       T_DOWN_Q8, T_COLUMNS };

/* Per layer, the columns of kvf_decoder_stack's block table (int64 each): what a family's
 * layer has beyond the plain Llama layer, each a float32 pointer or 0 for none, and the
 * layer's RoPE base.
 *   B_QKV_BIAS [q + 2 kv]    added to the qkv product (Qwen2);
 *   B_QK_NORM [hq + hkv, d]  each q and k head RMS-normalized and scaled by its row (Qwen3,
 *                            Gemma 3), after the bias, before RoPE;
 *   B_ROPE                   which of the step's RoPE tables the layer's q and k turn by;
 *   B_O_BIAS [hidden], B_GATE_UP_BIAS [2 inter], B_DOWN_BIAS [hidden]: added to the product;
 *   B_POST_ATTN, B_POST_MLP [hidden]: the o and down products RMS-normalized and scaled by
 *                            these before their residual add (Gemma's sandwich norms);
 *   B_ROUTER [experts, hidden], B_EXPERTS [experts, E_COLUMNS] int64, B_EXPERT_COUNT,
 *   B_TOP_K, B_NORM_TOP_K:   a mixture-of-experts MLP in place of the dense one (Mixtral,
 *                            Qwen3-MoE; experts_mlp), B_EXPERTS 0 for none. */
enum { B_QKV_BIAS, B_QK_NORM, B_ROPE, B_O_BIAS, B_GATE_UP_BIAS, B_DOWN_BIAS, B_POST_ATTN,
       B_POST_MLP, B_ROUTER, B_EXPERTS, B_EXPERT_COUNT, B_TOP_K, B_NORM_TOP_K, B_COLUMNS };

/* Per expert, the columns of a layer's expert table (B_EXPERTS): its gate_up [2 inter, hidden]
 * and down [hidden, inter] weights and their q8 flags, as the table's T_GATE_UP..T_DOWN_Q8. */
enum { E_GATE_UP, E_GATE_UP_Q8, E_DOWN, E_DOWN_Q8, E_COLUMNS };

/* The most experts a layer may have: a row's router logits are kept on the stack. */
#define MAX_EXPERTS 1024

int kvf_stack_max_experts(void) { return MAX_EXPERTS; }

int kvf_stack_block_columns(void) { return B_COLUMNS; }

int kvf_stack_columns(void) { return T_COLUMNS; }

/* LoRA weights are held as float32 (held = HELD_F32) or, where every value is one, as
 * bfloat16 (HELD_BF16) or float16 (HELD_F16), widened exactly to float32 where they are
 * read: the arithmetic is the same whichever way they are held. */
enum { HELD_F32, HELD_BF16, HELD_F16, HELD_KINDS };

static inline size_t held_bytes(int held) { return held == HELD_F32 ? 4 : 2; }

static inline float weight_at(const void *w, size_t i, int held) {
    if (held == HELD_F32) return ((const float *)w)[i];
    const uint16_t h = ((const uint16_t *)w)[i];
    if (held == HELD_F16) return fp16_to_f32(h);
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

#ifdef KVF_SIMD
static inline __m256 weights8(const void *w, size_t i, int held) {
    if (held == HELD_F32) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (held == HELD_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* LORA_GROUP rows at most share one pass over an adapter's weights (each weight is loaded
 * and widened once for them all). */
#define LORA_GROUP 4

/* dots[p][q] = the float32 dot product of x[q] and the weights w's row p (rows of length n
 * one after another), for q < nr and p < nw: each row's sum formed exactly as a lone row's
 * is, the weights read once for all the rows; two weight rows at once give each row's two
 * sums independent chains of multiply-adds. */
static inline __attribute__((always_inline)) void dots_weights(const float *const *x, int nr,
                                                               const void *w, int nw, int n,
                                                               int held,
                                                               float (*dots)[LORA_GROUP]) {
    int j = 0;
    float s[2][LORA_GROUP] = {{0.0f}};
    const size_t next = (size_t)n;
#ifdef KVF_SIMD
    __m256 s0[2][LORA_GROUP], s1[2][LORA_GROUP];
    for (int p = 0; p < nw; ++p)
        for (int q = 0; q < nr; ++q) s0[p][q] = s1[p][q] = _mm256_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        for (int p = 0; p < nw; ++p) {
            const __m256 w0 = weights8(w, p * next + j, held), w1 = weights8(w, p * next + j + 8, held);
            for (int q = 0; q < nr; ++q) {
                s0[p][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + j), w0, s0[p][q]);
                s1[p][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + j + 8), w1, s1[p][q]);
            }
        }
    }
    for (; j + 8 <= n; j += 8) {
        for (int p = 0; p < nw; ++p) {
            const __m256 w0 = weights8(w, p * next + j, held);
            for (int q = 0; q < nr; ++q)
                s0[p][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + j), w0, s0[p][q]);
        }
    }
    for (int p = 0; p < nw; ++p)
        for (int q = 0; q < nr; ++q) s[p][q] = hsum8(_mm256_add_ps(s0[p][q], s1[p][q]));
#endif
    for (; j < n; ++j) {
        for (int p = 0; p < nw; ++p) {
            const float wj = weight_at(w, p * next + j, held);
            for (int q = 0; q < nr; ++q) s[p][q] += x[q][j] * wj;
        }
    }
    for (int p = 0; p < nw; ++p)
        for (int q = 0; q < nr; ++q) dots[p][q] = s[p][q];
}

/* out[q][i] += u[q][j] * bt[j * stride + i] for j = 0 .. len - 1 in that order (one fmaf
 * each), for i < count and q < nr: the LoRA B product of count outputs of nr rows of one
 * adapter, its B stored rank-major. Each output's sum is formed as a lone row's is; each
 * weight is read once for all the rows. A pass keeps a run of outputs of every row in 8
 * registers (64 outputs of one row, 32 of two, 16 of three or four) across all the ranks,
 * reading each rank's part of that run (contiguous), and stores them once.
 * NOTE: measured on the 2-core AMX Xeon, SmolLM2-135M, 16 rows over 4 rank-16 adapters:
 * B stored output-major, one horizontal sum per output (a rank long) cost as much as its
 * multiply-adds; rank-major with one vector of sums in registers across ranks, each rank's
 * 32 bytes were a separate strided read, and 3/4 of the B product's samples sat on that
 * load; rank-major with each rank's outputs loaded, added and stored again, the deltas of
 * 16 rows of one adapter took 3.9 ms a step against 2.4 with the runs in registers. */
static inline __attribute__((always_inline)) void ranks_add(const float *const *u, int nr,
                                                            const void *bt, size_t stride,
                                                            int len, int count,
                                                            float *const *out, int held) {
    const size_t row = stride * held_bytes(held);
    int i = 0;
#ifdef KVF_SIMD
    /* outputs held in registers across the ranks: V vectors a row, 8 accumulators in all */
#define RANKS_PASS(V)                                                                      \
    for (; i + 8 * (V) <= count; i += 8 * (V)) {                                           \
        __m256 acc[LORA_GROUP][V];                                                         \
        for (int q = 0; q < nr; ++q)                                                       \
            for (int t = 0; t < (V); ++t) acc[q][t] = _mm256_loadu_ps(out[q] + i + 8 * t);  \
        const char *w = (const char *)bt + (size_t)i * held_bytes(held);                   \
        for (int j = 0; j < len; ++j, w += row) {                                          \
            __m256 wv[V];                                                                  \
            for (int t = 0; t < (V); ++t) wv[t] = weights8(w, 8 * t, held);                \
            for (int q = 0; q < nr; ++q) {                                                 \
                const __m256 uj = _mm256_set1_ps(u[q][j]);                                 \
                for (int t = 0; t < (V); ++t) acc[q][t] = _mm256_fmadd_ps(uj, wv[t], acc[q][t]); \
            }                                                                              \
        }                                                                                  \
        for (int q = 0; q < nr; ++q)                                                       \
            for (int t = 0; t < (V); ++t) _mm256_storeu_ps(out[q] + i + 8 * t, acc[q][t]); \
    }
    if (nr == 1) { RANKS_PASS(8) }
    else if (nr == 2) { RANKS_PASS(4) }
    else { RANKS_PASS(2) }
    RANKS_PASS(1)
#undef RANKS_PASS
#endif
    for (; i < count; ++i) {
        const char *w = (const char *)bt;
        for (int j = 0; j < len; ++j, w += row) {
            const float wi = weight_at(w, (size_t)i, held);
            for (int q = 0; q < nr; ++q) out[q][i] = fmaf(u[q][j], wi, out[q][i]);
        }
    }
}

/* dots_weights and ranks_add with nr and held made constants (a switch over each case), so
 * every call runs loops of fixed width on loads of one type. */
#define LORA_HELD(call, NR)                                                                \
    switch (held) {                                                                        \
    case HELD_F32: call(NR, HELD_F32); break;                                              \
    case HELD_BF16: call(NR, HELD_BF16); break;                                            \
    default: call(NR, HELD_F16); break;                                                    \
    }
#define LORA_CASES(call)                                                                   \
    switch (nr) {                                                                          \
    case 1: LORA_HELD(call, 1) break;                                                      \
    case 2: LORA_HELD(call, 2) break;                                                      \
    case 3: LORA_HELD(call, 3) break;                                                      \
    default: LORA_HELD(call, 4) break;                                                     \
    }

static void dots_group(const float *const *x, int nr, const void *w, int nw, int n, int held,
                       float (*dots)[LORA_GROUP]) {
#define DOTS2(NR, BF) dots_weights(x, NR, w, 2, n, BF, dots)
#define DOTS(NR, BF) dots_weights(x, NR, wp, 1, n, BF, dots + p)
    if (nw == 2 && nr == 1) {
        LORA_HELD(DOTS2, 1)
    } else if (nw == 2 && nr == 2) {
        LORA_HELD(DOTS2, 2)
    } else {
        /* three or four rows: one weight row at a time (eight chains already) */
        for (int p = 0; p < nw; ++p) {
            const void *wp = (const char *)w + (size_t)p * n * held_bytes(held);
            LORA_CASES(DOTS)
        }
    }
#undef DOTS
#undef DOTS2
}

static void ranks_group(const float *const *u, int nr, const void *bt, size_t stride, int len,
                        int count, float *const *out, int held) {
#define RANKS(NR, BF) ranks_add(u, NR, bt, stride, len, count, out, BF)
    LORA_CASES(RANKS)
#undef RANKS
}

/* below this many multiply-adds a LoRA delta runs on one thread
 * NOTE: measured on a 2-core AMX Xeon, SmolLM2-135M's shapes with rank-16 deltas on all seven
 * projections, one row, 30 layers' deltas (20 MB of float32 A and B): 0.69-0.77 ms with both
 * products of a delta in one parallel region from 4,096 multiply-adds (every delta of this
 * model on both threads) against 0.85-0.98 ms with a region a product from 32,768 (most
 * deltas on one thread). */
#define LORA_PARALLEL 4096

/* outputs a thread's share of the B product takes at a time (a block never crosses a module) */
#define LORA_BLOCK 128

/* out [rows, n] += ((in [rows, k] @ a.T) * mask) @ bt: one LoRA delta of a step's rows,
 * a [ranks, k] and bt [ranks, n] the step's adapters' weights stacked along the rank axis
 * (held as HELD_F32, HELD_BF16 or HELD_F16), mask [rows, ranks] each row's own adapter's ranks
 * (its scale) and 0 elsewhere.
 * Rank columns a row's mask zeroes are never computed, and a row with no nonzero mask
 * (a base row) gets nothing added: its values stay bit for bit the base projection's.
 * Rows with the same mask span (one adapter's) go through its weights together, up to
 * LORA_GROUP at once; each output still adds its row's ranks in rank order, whatever the
 * rows, their grouping, the threads or the output's place in its block: a row's delta does
 * not depend on the step it is in.
 * With parts > 1, bt is block-diagonal by module, as a fused projection's adapters are built
 * (service/model/lora.py): the outputs stack parts modules, module j's ending at ends[j]
 * (ends[parts - 1] = n), each adapter's rank block stacks one rank slice per module in the
 * same order, and module j's outputs have nonzero bt only in the j-th slice; a row whose mask
 * span divides into parts slices then reads only its module's slice (the other products are 0).
 * u [rows, ranks] and span (4 ints a row and 1) are scratch.
 * A job is planned once (lora_plan); its two products are split over the threads of
 * whichever parallel region calls them (lora_products: lora_ranks, then lora_outputs once
 * every thread's lora_ranks is done), the base projection's own (gemv) or lora_run's. */

/* Where module m of a job's outputs starts and stops. */
static inline void module_outputs(const lora_job *job, int m, int *from, int *stop) {
    *from = m == 0 ? 0 : job->ends[m - 1];
    *stop = job->parts > 1 ? job->ends[m] : job->n;
}

/* How many output blocks module m of a job has (a block never crosses a module). */
static inline int module_blocks(const lora_job *job, int m) {
    int from, stop;
    module_outputs(job, m, &from, &stop);
    return (stop - from + LORA_BLOCK - 1) / LORA_BLOCK;
}

/* Plans job for the arguments above: each row's span, the rows' groups, the output blocks. */
static void lora_plan(lora_job *job, const float *in, float *spare, int rows, int k,
                      const void *a, const void *bt, int held, const float *mask, int ranks,
                      int n, int parts, const int *ends, float *out, float *u, int *span) {
    /* span: each row's [lo, hi), then the rows with a nonzero span ordered by it, then where
     * each group of them (up to LORA_GROUP rows of one span) starts in that order */
    int *order = span + 2 * rows, *starts = order + rows, live = 0, groups = 0;
    for (int r = 0; r < rows; ++r) {
        const float *mr = mask + (size_t)r * ranks;
        int lo = 0, hi = ranks;
        while (lo < ranks && mr[lo] == 0.0f) ++lo;
        while (hi > lo && mr[hi - 1] == 0.0f) --hi;
        span[2 * r] = lo;
        span[2 * r + 1] = hi;
        if (lo >= hi) continue;
        int at = live++;
        for (; at > 0 && span[2 * order[at - 1]] > lo; --at) order[at] = order[at - 1];
        order[at] = r;
    }
    /* a group ends where the span changes or it holds LORA_GROUP rows */
    for (int g = 0; g < live; ++g) {
        const int *first = groups > 0 ? span + 2 * order[starts[groups - 1]] : NULL;
        const int *here = span + 2 * order[g];
        if (first == NULL || g - starts[groups - 1] == LORA_GROUP || here[0] != first[0] ||
            here[1] != first[1])
            starts[groups++] = g;
    }
    starts[groups] = live;
    *job = (lora_job){in, mask, a, bt, parts > 1 ? ends : NULL, out, u, spare, span, order, starts,
                      rows, k, n, held, ranks, parts, groups, 0,
                      (size_t)live * ranks * ((size_t)k + n)};
    for (int m = 0; m < parts; ++m) job->blocks += module_blocks(job, m);
}

/* Output block blk of a job: its module and first output, and how many outputs it has. */
static inline void output_block(const lora_job *job, int blk, int *module, int *i0, int *count) {
    int m = 0, left = blk;
    for (; left >= module_blocks(job, m); ++m) left -= module_blocks(job, m);
    int from, stop;
    module_outputs(job, m, &from, &stop);
    *module = m;
    *i0 = from + left * LORA_BLOCK;
    *count = stop - *i0 < LORA_BLOCK ? stop - *i0 : LORA_BLOCK;
}

/* Group t's ranks [lo, hi) that output module m reads. */
static inline void group_module_ranks(const lora_job *job, int t, int m, int *lo, int *hi) {
    const int *first = job->span + 2 * job->order[job->starts[t]];
    *lo = first[0];
    *hi = first[1];
    if (job->parts > 1 && (*hi - *lo) % job->parts == 0) {
        const int slice = (*hi - *lo) / job->parts;
        *lo += m * slice;
        *hi = *lo + slice;
    }
}

/* Whether group t reads the same ranks as the group before it (one adapter's rows past
 * LORA_GROUP): its weights are already on their way. */
static inline int same_span_as_previous(const lora_job *job, int t) {
    if (t == 0) return 0;
    const int *a = job->span + 2 * job->order[job->starts[t - 1]];
    const int *b = job->span + 2 * job->order[job->starts[t]];
    return a[0] == b[0] && a[1] == b[1];
}

static inline void prefetch_bytes(const char *p, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

/* Asks for this thread's shares of the job's weights (lora_ranks's and lora_outputs's) to be
 * brought towards its core, for the time the base projection's panels take.
 * NOTE: measured on the 2-core AMX Xeon, SmolLM2-135M, rank-16 bfloat16 adapters on all seven
 * projections, both builds in one process taking turns: 16 decode rows over 4 adapters
 * (~40 MB of A and B a step) took 0.44 ms a step less with these prefetches (15 of 16
 * rounds faster); one row was unchanged within the host's noise. */
static void lora_prefetch(const lora_job *job) {
    const size_t elem = held_bytes(job->held);
    int lo, hi;
    thread_share((job->ranks + 1) / 2, &lo, &hi);
    for (int t = 0; t < job->groups; ++t) {
        if (same_span_as_previous(job, t)) continue;
        const int *first = job->span + 2 * job->order[job->starts[t]];
        const int j = 2 * lo > first[0] ? 2 * lo : first[0];
        const int end = 2 * hi < first[1] ? 2 * hi : first[1];
        if (j < end)
            prefetch_bytes((const char *)job->a + (size_t)j * job->k * elem,
                           (size_t)(end - j) * job->k * elem);
    }
    thread_share(job->blocks, &lo, &hi);
    for (int blk = lo; blk < hi; ++blk) {
        int module, i0, count;
        output_block(job, blk, &module, &i0, &count);
        for (int t = 0; t < job->groups; ++t) {
            if (same_span_as_previous(job, t)) continue;
            int rlo, rhi;
            group_module_ranks(job, t, module, &rlo, &rhi);
            for (int j = rlo; j < rhi; ++j)
                prefetch_bytes((const char *)job->bt + ((size_t)j * job->n + i0) * elem,
                               (size_t)count * elem);
        }
    }
}

/* u = (in @ a.T) * mask for the job's rows and ranks, two ranks at a time: this thread's
 * share of the pairs (thread_share; lora_outputs may start once every thread is done). */
static void lora_ranks(const lora_job *job) {
    const int *span = job->span, *order = job->order, *starts = job->starts;
    const int ranks = job->ranks, k = job->k, held = job->held;
    const size_t elem = held_bytes(held);
    int from, to;
    thread_share((ranks + 1) / 2, &from, &to);
    for (int pair = from; pair < to; ++pair) {
        for (int t = 0; t < job->groups; ++t) {
            const int *idx = order + starts[t], nr = starts[t + 1] - starts[t];
            const int lo = span[2 * idx[0]], hi = span[2 * idx[0] + 1];
            /* the pair's ranks inside the group's span: [j, end) */
            int j = 2 * pair, end = j + 2 < ranks ? j + 2 : ranks;
            if (j < lo) j = lo;
            if (end > hi) end = hi;
            if (j >= end) continue;
            const int nw = end - j;
            const float *x[LORA_GROUP];
            for (int q = 0; q < nr; ++q) x[q] = job->in + (size_t)idx[q] * k;
            float dots[2][LORA_GROUP];
            dots_group(x, nr, (const char *)job->a + (size_t)j * k * elem, nw, k, held, dots);
            for (int p = 0; p < nw; ++p)
                for (int q = 0; q < nr; ++q) {
                    const float m = job->mask[(size_t)idx[q] * ranks + j + p];
                    job->u[(size_t)idx[q] * ranks + j + p] = m == 0.0f ? 0.0f : dots[p][q] * m;
                }
        }
    }
}

/* out += u @ bt for the job's rows, a block of LORA_BLOCK outputs of one module at a time:
 * this thread's share of the blocks (thread_share). */
static void lora_outputs(const lora_job *job) {
    const int *order = job->order, *starts = job->starts;
    const int n = job->n, ranks = job->ranks;
    const size_t elem = held_bytes(job->held);
    int from, to;
    thread_share(job->blocks, &from, &to);
    for (int blk = from; blk < to; ++blk) {
        int module, i0, count;
        output_block(job, blk, &module, &i0, &count);
        for (int t = 0; t < job->groups; ++t) {
            const int *idx = order + starts[t], nr = starts[t + 1] - starts[t];
            int lo, hi;
            group_module_ranks(job, t, module, &lo, &hi);
            const float *ur[LORA_GROUP];
            float *dst[LORA_GROUP];
            for (int q = 0; q < nr; ++q) {
                ur[q] = job->u + (size_t)idx[q] * ranks + lo;
                dst[q] = job->out + (size_t)idx[q] * n + i0;
            }
            ranks_group(ur, nr, (const char *)job->bt + ((size_t)lo * n + i0) * elem, (size_t)n,
                        hi - lo, count, dst, job->held);
        }
    }
}

/* Whether a job's products take both threads' time (else they run on the calling thread). */
static int lora_parallel(const lora_job *job) { return job->work >= LORA_PARALLEL; }

/* The job's two products on the region's threads: the rank products, a barrier (past which
 * every thread's work before it is done too: the base products the delta adds to), the
 * output products. */
static void lora_products(const lora_job *job) {
    lora_ranks(job);
#pragma omp barrier
    lora_outputs(job);
}

/* The job's products in a region of their own. */
static inline void lora_run(const lora_job *job) {
#pragma omp parallel if (lora_parallel(job))
    lora_products(job);
}

/* Per layer and fused projection (qkv, o, gate_up, down, in that order), the columns of
 * kvf_decoder_stack's LoRA table (int64 each): a [R, k] and bt [R, n] pointers (the layer's
 * slice of the step's stacked adapter weights), mask [rows, R] float32, R, the parts bt is
 * block-diagonal in, and how a and bt are held (HELD_F32, HELD_BF16, HELD_F16); R = 0 is no
 * delta for that projection in that layer. */
enum { L_A, L_B, L_MASK, L_RANKS, L_PARTS, L_HELD, L_COLUMNS };
enum { G_QKV, G_O, G_GATE_UP, G_DOWN, G_COUNT };
#define LORA_MAX_RANKS 65536

int kvf_stack_lora_columns(void) { return G_COUNT * L_COLUMNS; }

/* The LoRA table's entry of projection g in layer l when it has a delta, else NULL. */
static inline const int64_t *lora_entry(const int64_t *lora, int l, int g) {
    if (lora == NULL) return NULL;
    const int64_t *e = lora + ((size_t)l * G_COUNT + g) * L_COLUMNS;
    return e[L_RANKS] > 0 ? e : NULL;
}

/* The job of table entry e's delta (k inputs, n outputs) planned in job, or NULL when e is
 * NULL (no delta); in its input, or NULL for the base product's own (spare [rows, k]: where
 * the base product makes none); ends: its modules' row ends when e has parts > 1 (checked
 * against them on entry to kvf_decoder_stack). */
static inline lora_job *lora_for(lora_job *job, const int64_t *e, const float *in, float *spare,
                                 int rows, int k, int n, const int *ends, float *out, float *u,
                                 int *span) {
    if (e == NULL) return NULL;
    lora_plan(job, in, spare, rows, k, (const void *)(intptr_t)e[L_A],
              (const void *)(intptr_t)e[L_B], (int)e[L_HELD], (const float *)(intptr_t)e[L_MASK],
              (int)e[L_RANKS], n, (int)e[L_PARTS], ends, out, u, span);
    return job;
}

/* from this many rows a job's own input (lora_input) is made on every thread
 * NOTE: measured on the 2-core AMX Xeon, SmolLM2-135M, 16 rows on rank-1 adapters: the
 * deltas' own work aside, a step cost ~2.3 ms more than the base's, the other thread
 * waiting at a barrier while one made every row's gate (1536 SiLUs a row, 30 layers). */
#define LORA_ROWS_PARALLEL 4

/* A job without an input gets x's rows after the gate and norm (input_row) in its spare, for
 * a base product that made none of its own. */
static inline void lora_input(lora_job *job, const float *x, int gated, const float *gamma,
                              float eps) {
    if (job->in != NULL) return;
    const int rows = job->rows, k = job->k;
#pragma omp parallel for schedule(static) if (rows >= LORA_ROWS_PARALLEL)
    for (int r = 0; r < rows; ++r)
        input_row(x + (size_t)r * k * (gated ? 2 : 1), k, gated, gamma, eps,
                  job->spare + (size_t)r * k);
    job->in = job->spare;
}

static inline const float *float_at(int64_t address) { return (const float *)(intptr_t)address; }

/* rows of x [rows, width] += bias [width] */
static void add_bias(float *x, int rows, int width, const float *bias) {
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < width; ++j) x[(size_t)r * width + j] += bias[j];
}

/* v [dim] = v / sqrt(mean(v^2) + eps) * gamma [dim], as F.rms_norm computes it. */
static void rms_scale(float *v, int dim, const float *gamma, float eps) {
    float ss = 0.0f;
    for (int j = 0; j < dim; ++j) ss += v[j] * v[j];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int j = 0; j < dim; ++j) v[j] = v[j] * inv * gamma[j];
}

/* x [rows, width] += each row of a RMS-normalized and scaled by gamma (a is overwritten). */
static void add_normed(float *x, float *a, int rows, int width, const float *gamma, float eps) {
    for (int r = 0; r < rows; ++r) {
        float *ar = a + (size_t)r * width, *xr = x + (size_t)r * width;
        rms_scale(ar, width, gamma, eps);
        for (int j = 0; j < width; ++j) xr[j] += ar[j];
    }
}

/* The o product of kvf_mlp and its residual add, with what the layer's ``block`` row
 * (B_COLUMNS, or NULL for none) adds: the o bias, and the post-norm (x += rms_norm(product)
 * instead of x += product; the product made in a [rows, hidden]). With the LoRA delta of
 * entry lo (NULL: none) on attn, added after the product. v [rows, max(hidden, inter)], u and
 * span (4 ints a row and 1) scratch. */
static int attn_out(float *x, const float *attn, int rows, int hidden, int q_size,
                    const uint8_t *o, int o_q8, float eps, const int64_t *block, float *a,
                    const int64_t *lo, float *v, float *u, int *span) {
    lora_job job;
    const float *o_bias = block == NULL ? NULL : float_at(block[B_O_BIAS]);
    const float *post_attn = block == NULL ? NULL : float_at(block[B_POST_ATTN]);
    float *o_out = post_attn == NULL ? x : a;
    if (gemv(attn, rows, q_size, o, hidden, o_out, o_q8, GATE_NONE, NULL, 0.0f, post_attn == NULL,
             NULL, 0, 0, lora_for(&job, lo, attn, v, rows, q_size, hidden, NULL, o_out, u, span)) != 0)
        return -1;
    if (o_bias != NULL) add_bias(o_out, rows, hidden, o_bias);
    if (post_attn != NULL) add_normed(x, a, rows, hidden, post_attn, eps);
    return 0;
}

/* The rest of kvf_mlp (norm, gate_up, act, down, residual add), with the layer's gate_up and
 * down biases and MLP post-norm from ``block`` (as attn_out); ``act`` the gate's activation
 * (GATE_SILU or GATE_GELU_TANH). With the LoRA deltas of entries gu and down (each NULL:
 * none) added after their products: gate_up's on the normed x, down's on act(gate) * up. */
static int dense_mlp(float *x, float *h, int rows, int hidden, int inter, const float *gamma,
                     float eps, const uint8_t *gate_up, int gate_up_q8, const uint8_t *down,
                     int down_q8, const int64_t *block, int act, float *a, const int64_t *lgu,
                     const int64_t *ldown, float *v, float *u, int *span) {
    lora_job job;
    const int halves[2] = {inter, 2 * inter};
    const float *gate_up_bias = block == NULL ? NULL : float_at(block[B_GATE_UP_BIAS]);
    const float *down_bias = block == NULL ? NULL : float_at(block[B_DOWN_BIAS]);
    const float *post_mlp = block == NULL ? NULL : float_at(block[B_POST_MLP]);
    if (gemv(x, rows, hidden, gate_up, 2 * inter, h, gate_up_q8, GATE_NONE, gamma, eps, 0, NULL, 0,
             0, lora_for(&job, lgu, NULL, v, rows, hidden, 2 * inter, halves, h, u, span)) != 0)
        return -1;
    if (gate_up_bias != NULL) add_bias(h, rows, 2 * inter, gate_up_bias);
    float *down_out = post_mlp == NULL ? x : a;
    if (gemv(h, rows, inter, down, hidden, down_out, down_q8, act, NULL, 0.0f, post_mlp == NULL,
             NULL, 0, 0, lora_for(&job, ldown, NULL, v, rows, inter, hidden, NULL, down_out, u, span)) != 0)
        return -1;
    if (down_bias != NULL) add_bias(down_out, rows, hidden, down_bias);
    if (post_mlp != NULL) add_normed(x, a, rows, hidden, post_mlp, eps);
    return 0;
}

/* kvf_mlp's three products (attn_out, then dense_mlp). Without a block and with GATE_SILU
 * these are the plain layer's three calls, each product added to x inside its call. */
static int mlp(float *x, const float *attn, float *h, int rows, int hidden, int q_size,
               int inter, const uint8_t *o, int o_q8, const float *gamma, float eps,
               const uint8_t *gate_up, int gate_up_q8, const uint8_t *down, int down_q8,
               const int64_t *block, int act, float *a, const int64_t *lo, const int64_t *lgu,
               const int64_t *ldown, float *v, float *u, int *span) {
    if (attn_out(x, attn, rows, hidden, q_size, o, o_q8, eps, block, a, lo, v, u, span) != 0)
        return -1;
    return dense_mlp(x, h, rows, hidden, inter, gamma, eps, gate_up, gate_up_q8, down, down_q8,
                     block, act, a, lgu, ldown, v, u, span);
}

/* Row hn [hidden]'s routing, as service.model.moe.route computes it: float32 logits
 * (hn @ router.T, router [count, hidden]), their softmax, the top_k largest probabilities
 * (ties to the lower expert, as torch.topk picks them), with normalize divided by their sum
 * (taken in rank order). Answers in weight [count] each expert's weight, 0 for those not
 * picked; picked [count] 1 for the picked. */
static void route(const float *hn, int hidden, const float *router, int count, int top_k,
                  int normalize, float *weight, unsigned char *picked) {
    float top = -INFINITY, sum = 0.0f;
    for (int e = 0; e < count; ++e) {
        const float *w = router + (size_t)e * hidden;
        float s = 0.0f;
        for (int j = 0; j < hidden; ++j) s += hn[j] * w[j];
        weight[e] = s;
        picked[e] = 0;
        if (s > top) top = s;
    }
    for (int e = 0; e < count; ++e) {
        weight[e] = expf(weight[e] - top);
        sum += weight[e];
    }
    const float inv = 1.0f / sum;
    for (int e = 0; e < count; ++e) weight[e] *= inv;
    int rank[MAX_EXPERTS];
    float kept = 0.0f;
    for (int k = 0; k < top_k; ++k) {
        int best = -1;
        for (int e = 0; e < count; ++e) /* strictly larger: a tie keeps the lower expert */
            if (!picked[e] && (best < 0 || weight[e] > weight[best])) best = e;
        picked[best] = 1;
        rank[k] = best;
        kept += weight[best];
    }
    for (int e = 0; e < count; ++e)
        if (!picked[e]) weight[e] = 0.0f;
    for (int k = 0; normalize && k < top_k; ++k) weight[rank[k]] /= kept;
}

/* A mixture-of-experts MLP (the layer's block row: B_ROUTER, B_EXPERTS, ...) in place of
 * dense_mlp, each row on its own: its normed input (gamma), its routing (route), then for each
 * picked expert in expert order its gate_up product, act(gate) * up into its down product,
 * and m += weight * that (m from 0), then x += m (or its post-norm, B_POST_MLP). A row's
 * arithmetic is the same whichever rows are beside it; experts add in index order, as
 * moe_mlp's index_add_ over its expert-sorted assignments does. h [2 inter], a [hidden] and
 * moe [2 hidden] scratch. */
static int experts_mlp(float *x, int rows, int hidden, int inter, const float *gamma, float eps,
                       const int64_t *block, int act, float *h, float *a, float *moe) {
    const int count = (int)block[B_EXPERT_COUNT], top_k = (int)block[B_TOP_K];
    const float *router = float_at(block[B_ROUTER]);
    const int64_t *experts = (const int64_t *)(intptr_t)block[B_EXPERTS];
    const float *post_mlp = float_at(block[B_POST_MLP]);
    float *hn = moe, *m = moe + hidden;
    float weight[MAX_EXPERTS];
    unsigned char picked[MAX_EXPERTS];
    for (int r = 0; r < rows; ++r) {
        float *xr = x + (size_t)r * hidden;
        input_row(xr, hidden, GATE_NONE, gamma, eps, hn);
        route(hn, hidden, router, count, top_k, (int)block[B_NORM_TOP_K], weight, picked);
        memset(m, 0, sizeof(float) * (size_t)hidden);
        for (int e = 0; e < count; ++e) {
            if (!picked[e]) continue;
            const int64_t *ex = experts + (size_t)e * E_COLUMNS;
            if (gemv(hn, 1, hidden, (const uint8_t *)(intptr_t)ex[E_GATE_UP], 2 * inter, h,
                     (int)ex[E_GATE_UP_Q8], GATE_NONE, NULL, 0.0f, 0, NULL, 0, 0, NULL) != 0 ||
                gemv(h, 1, inter, (const uint8_t *)(intptr_t)ex[E_DOWN], hidden, a,
                     (int)ex[E_DOWN_Q8], act, NULL, 0.0f, 0, NULL, 0, 0, NULL) != 0)
                return -1;
            const float w = weight[e];
            for (int j = 0; j < hidden; ++j) m[j] += w * a[j];
        }
        if (post_mlp == NULL)
            for (int j = 0; j < hidden; ++j) xr[j] += m[j];
        else
            add_normed(xr, m, 1, hidden, post_mlp, eps);
    }
    return 0;
}

/* Whether layer block b's experts (if any) are ones kvf_decoder_stack takes: a count of 1 to
 * MAX_EXPERTS, top_k of 1 to count, a router and every expert's weights, and no dense MLP
 * biases or gate_up/down LoRA deltas (lgu, ldown) beside them. */
static int experts_ok(const int64_t *b, const int64_t *lgu, const int64_t *ldown) {
    if (b == NULL || b[B_EXPERTS] == 0) return 1;
    const int64_t count = b[B_EXPERT_COUNT], top_k = b[B_TOP_K];
    if (count < 1 || count > MAX_EXPERTS || top_k < 1 || top_k > count || b[B_ROUTER] == 0 ||
        b[B_GATE_UP_BIAS] != 0 || b[B_DOWN_BIAS] != 0 || lgu != NULL || ldown != NULL)
        return 0;
    const int64_t *experts = (const int64_t *)(intptr_t)b[B_EXPERTS];
    for (int64_t e = 0; e < count; ++e)
        if (experts[e * E_COLUMNS + E_GATE_UP] == 0 || experts[e * E_COLUMNS + E_DOWN] == 0)
            return 0;
    return 1;
}

/* A whole decode forward's decoder layers in one call, for rows tokens of rows sequences:
 * per layer l, the same calls the layer-by-layer path makes,
 *   qkv = rms_norm(x, attn_norm) @ qkv.T, plus the bias, each q and k head normed
 *         (blocks' B_QKV_BIAS, B_QK_NORM; each where the layer has it), RoPE on the q and k
 *         heads by the layer's table (B_ROPE of rope_tables tables of [rows, 2, dim] one
 *         after another in rope), q times query_scale;
 *   out = attend(ctx, l, q, k, v)        kvcache's write and attention;
 *   mlp(x, out, ...)                     o, residual, norm, gate/up, act, down, residual,
 *                                        with the layer's biases and post-norms; where the
 *                                        block row names experts, the o half and then
 *                                        experts_mlp (router, top-k, each picked expert).
 * x [rows, hidden] float32, updated in place; table [layers, T_COLUMNS]; blocks [layers,
 * B_COLUMNS] or NULL (the plain Llama layer: none of them, RoPE table 0); act the MLP gate's
 * activation (GATE_SILU, GATE_GELU_TANH). With lora [layers, G_COUNT, L_COLUMNS] (else NULL)
 * each projection with an entry also adds its rows' LoRA delta (lora_plan) where the layer
 * loop adds it: qkv's on the normed x before the bias, o's on the attention output,
 * gate_up's on the normed x, down's on act(gate) * up.
 * Returns 0; -1 when a shape is outside what the kernel takes (found before anything is
 * written: every layer has the same shapes) or scratch memory cannot be had; -2 when attend
 * refused a layer (it wrote nothing for it, and x holds that layer's input).
 * NOTE: measured on a 2-core AVX2 EPYC, SmolLM2-135M at B=1: the Python layer loop around
 * the same three calls a layer (views, copies, checks) cost ~2 ms a step. */
int kvf_decoder_stack(float *x, int rows, int hidden, int layers, const int64_t *table,
                      const int64_t *blocks, int q_heads, int kv_heads, int dim, int inter,
                      float eps, int act, float query_scale, const float *rope, int rope_tables,
                      attend_fn attend, const void *ctx, const int64_t *lora) {
    const int q_size = q_heads * dim, kv_size = kv_heads * dim, n_qkv = q_size + 2 * kv_size;
    const int ks[3] = {hidden, q_size, inter};
    for (int i = 0; i < 3; ++i)
        if (ks[i] < BLOCK || ks[i] % BLOCK != 0 || ks[i] / BLOCK > MAX_GROUPS) return -1;
    if (rows < 1 || rows > MAX_ROWS || layers < 1 || q_heads < 1 || kv_heads < 1 || dim < 2 ||
        dim % 2 != 0 || inter < 1 || rope == NULL || attend == NULL || table == NULL ||
        rope_tables < 1 || (act != GATE_SILU && act != GATE_GELU_TANH) || !isfinite(query_scale))
        return -1;
    for (int l = 0; blocks != NULL && l < layers; ++l) {
        const int64_t *b = blocks + (size_t)l * B_COLUMNS;
        if (b[B_ROPE] < 0 || b[B_ROPE] >= rope_tables) return -1;
        if (!experts_ok(b, lora_entry(lora, l, G_GATE_UP), lora_entry(lora, l, G_DOWN))) return -1;
    }
    const size_t r = (size_t)rows;
    const int qkv_ends[3] = {q_size, q_size + kv_size, n_qkv};
    int64_t max_ranks = 0;
    for (size_t e = 0; lora != NULL && e < (size_t)layers * G_COUNT; ++e) {
        const int64_t *g = lora + e * L_COLUMNS;
        if (g[L_RANKS] < 0 || g[L_RANKS] > LORA_MAX_RANKS) return -1;
        if (g[L_RANKS] == 0) continue; /* no delta on this projection: the rest is unread */
        if (g[L_A] == 0 || g[L_B] == 0 || g[L_MASK] == 0) return -1;
        /* only qkv (q|k|v) and gate_up (gate|up) are block-diagonal by module */
        const int most = e % G_COUNT == G_QKV ? 3 : e % G_COUNT == G_GATE_UP ? 2 : 1;
        if (g[L_PARTS] != 1 && g[L_PARTS] != most) return -1;
        if (g[L_HELD] < 0 || g[L_HELD] >= HELD_KINDS) return -1;
        if (g[L_RANKS] > max_ranks) max_ranks = g[L_RANKS];
    }
    /* qkv, then q, k, v (contiguous per head block), attention output, gate/up, a product's
     * rows before their post-norm, and an expert row's normed input and sum (experts_mlp) */
    float *buf = malloc(sizeof(float) *
                        (r * ((size_t)n_qkv * 2 + q_size + 2 * (size_t)inter + (size_t)hidden) +
                         2 * (size_t)hidden));
    if (buf == NULL) return -1;
    /* with deltas: a product's normed or gated input [rows, max(hidden, inter)], u, span */
    const size_t wide = (size_t)(hidden > inter ? hidden : inter);
    float *lbuf = NULL;
    if (max_ranks > 0) {
        lbuf = malloc(sizeof(float) * r * (wide + (size_t)max_ranks) + sizeof(int) * (4 * r + 1));
        if (lbuf == NULL) {
            free(buf);
            return -1;
        }
    }
    float *lv = lbuf, *lu = lbuf == NULL ? NULL : lbuf + r * wide;
    int *span = lbuf == NULL ? NULL : (int *)(lu + r * (size_t)max_ranks);
    float *qkv = buf, *q = qkv + r * n_qkv, *k = q + r * q_size, *v = k + r * kv_size;
    float *out = v + r * kv_size, *h = out + r * q_size, *a = h + r * 2 * (size_t)inter;
    float *moe = a + r * (size_t)hidden;
    int status = 0;
    for (int l = 0; l < layers && status == 0; ++l) {
        const int64_t *t = table + (size_t)l * T_COLUMNS;
        const int64_t *b = blocks == NULL ? NULL : blocks + (size_t)l * B_COLUMNS;
        const float *attn_norm = float_at(t[T_ATTN_NORM]);
        const float *qkv_bias = b == NULL ? NULL : float_at(b[B_QKV_BIAS]);
        const float *qk_norm = b == NULL ? NULL : float_at(b[B_QK_NORM]);
        const float *turn = rope + (size_t)(b == NULL ? 0 : b[B_ROPE]) * r * 2 * (size_t)dim;
        /* RoPE in the product's call, or after the bias and head norms where there are some */
        const int after = qkv_bias != NULL || qk_norm != NULL;
        const int64_t *dq = lora_entry(lora, l, G_QKV), *dout = lora_entry(lora, l, G_O);
        const int64_t *dgu = lora_entry(lora, l, G_GATE_UP), *ddown = lora_entry(lora, l, G_DOWN);
        /* the delta goes in before RoPE: the product, then the delta, then RoPE */
        lora_job job;
        if (gemv(x, rows, hidden, (const uint8_t *)(intptr_t)t[T_QKV], n_qkv, qkv,
                 (int)t[T_QKV_Q8], GATE_NONE, attn_norm, eps, 0, after ? NULL : turn,
                 q_heads + kv_heads, dim,
                 lora_for(&job, dq, NULL, lv, rows, hidden, n_qkv, qkv_ends, qkv, lu, span)) != 0) {
            status = -1;
            break;
        }
        if (qkv_bias != NULL) add_bias(qkv, rows, n_qkv, qkv_bias);
        for (size_t i = 0; qk_norm != NULL && i < r; ++i)
            for (int hd = 0; hd < q_heads + kv_heads; ++hd)
                rms_scale(qkv + i * n_qkv + (size_t)hd * dim, dim, qk_norm + (size_t)hd * dim, eps);
        if (after) rope_rows(qkv, rows, n_qkv, q_heads + kv_heads, dim, turn);
        for (size_t i = 0; i < r; ++i) {
            const float *src = qkv + i * n_qkv;
            memcpy(q + i * q_size, src, sizeof(float) * q_size);
            memcpy(k + i * kv_size, src + q_size, sizeof(float) * kv_size);
            memcpy(v + i * kv_size, src + q_size + kv_size, sizeof(float) * kv_size);
        }
        if (query_scale != 1.0f)
            for (size_t i = 0; i < r * (size_t)q_size; ++i) q[i] *= query_scale;
        if (attend(ctx, l, q, k, v, out) != 0) {
            status = -2;
            break;
        }
        status = attn_out(x, out, rows, hidden, q_size, (const uint8_t *)(intptr_t)t[T_O],
                          (int)t[T_O_Q8], eps, b, a, dout, lv, lu, span);
        if (status != 0) break;
        if (b != NULL && b[B_EXPERTS] != 0)
            status = experts_mlp(x, rows, hidden, inter, float_at(t[T_MLP_NORM]), eps, b, act, h,
                                 a, moe);
        else
            status = dense_mlp(x, h, rows, hidden, inter, float_at(t[T_MLP_NORM]), eps,
                               (const uint8_t *)(intptr_t)t[T_GATE_UP], (int)t[T_GATE_UP_Q8],
                               (const uint8_t *)(intptr_t)t[T_DOWN], (int)t[T_DOWN_Q8], b, act, a,
                               dgu, ddown, lv, lu, span);
    }
    free(lbuf);
    free(buf);
    return status;
}
