/* What every part shares: the ISA macros (KVF_SIMD), fp16, the layout flags and
 * limits, the per-thread scratch, and prepare(): a call's input rows (gate, norm) as int16
 * blocks with their steps and sums.
 * Part of kvf.c (one translation unit). */

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
/* In a weight's q8 argument: the weights are in the panel layout (panels.h). */
#define KVF_PANELS 4
/* In a weight's q8 argument: the row layout's scales (and minimums) are float32, and 8-bit
 * blocks have two scales, one per 16 codes (the wide layouts in kvf.c). */
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
