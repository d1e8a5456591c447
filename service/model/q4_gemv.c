/* 4-bit GEMV for float32 activations on CPU: out[m, n] = sum_k x[m, k] * w[n, k] for a few
 * rows m (decode batches), reading the weights as GGUF Q4_1 blocks.
 *
 * Built by service/model/native_gemv.py with the system C compiler and loaded through ctypes
 * (the GIL is released for the call). OpenMP resolves to the libgomp torch already loaded,
 * so the kernel shares the calling thread's worker pool.
 *
 * Why: torch's _weight_int4pack_mm_for_cpu is fast for bf16 activations only; with float32
 * (CPUs without AVX512-BF16, where kvfence computes in float32) it ran 15-19x slower than
 * the dense float32 matmul it was meant to beat, so such hosts read ~540 MB of float32
 * weights a token instead of ~85 MB of 4-bit blocks.
 *
 * Layout (kvf_q4_gemv): row n is K / 32 blocks of 20 bytes, each {fp16 d, fp16 m, 16 bytes of nibbles};
 * byte j of a block holds element j in its low nibble and element j + 16 in its high one
 * (ggml's Q4_1), and the block's weights are w = d * q + m. So
 *   sum_k x_k w_k = sum_blocks (d * sum_j q_j x_j + m * sum_j x_j)
 * and the x sums are taken once per call. The products are float32, exact for the codes;
 * only the summation order differs from a dense float32 matmul. kvf_q8_gemv reads GGUF Q8_0
 * blocks ({fp16 d, 32 int8 q}, w = d * q) the same way.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define BLOCK_BYTES 20
#define Q8_BLOCK_BYTES 34
#define MAX_ROWS 8

static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        if (mant == 0) { v.u = sign; return v.f; }
        /* subnormal half: normalize */
        int e = -1;
        do { mant <<= 1; ++e; } while ((mant & 0x400u) == 0);
        v.u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
        return v.f;
    }
    if (exp == 31) { v.u = sign | 0x7f800000u | (mant << 13); return v.f; }
    v.u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    return v.f;
}

int kvf_q4_max_rows(void) { return MAX_ROWS; }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVF_SIMD 1

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return fp16_to_f32(h);
#endif
}

/* One output column n for rows 0..rows-1; called with a constant ``rows`` so that the
 * compiler unrolls the row loop and keeps every accumulator in a register. */
static inline __attribute__((always_inline)) void row_dot_n(
    const float *x, const float *xsum, const int rows, int k, int groups,
    const uint8_t *wrow, float *out, int n, int n_total) {
    __m256 acc[MAX_ROWS];
    float macc[MAX_ROWS];
    for (int r = 0; r < rows; ++r) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.0f; }
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int g = 0; g < groups; ++g) {
        const uint8_t *blk = wrow + (size_t)g * BLOCK_BYTES;
        const __m256 d = _mm256_set1_ps(half_at(blk));
        const float m = half_at(blk + 2);
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i lo = _mm_and_si128(q, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
        const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 f2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 f3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        for (int r = 0; r < rows; ++r) {
            const float *xp = x + (size_t)r * k + (size_t)g * BLOCK;
            __m256 t0 = _mm256_mul_ps(f0, _mm256_loadu_ps(xp));
            __m256 t1 = _mm256_mul_ps(f1, _mm256_loadu_ps(xp + 8));
            t0 = _mm256_fmadd_ps(f2, _mm256_loadu_ps(xp + 16), t0);
            t1 = _mm256_fmadd_ps(f3, _mm256_loadu_ps(xp + 24), t1);
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, acc[r]);
            macc[r] += m * xsum[(size_t)r * groups + g];
        }
    }
    for (int r = 0; r < rows; ++r) out[(size_t)r * n_total + n] = hsum8(acc[r]) + macc[r];
}

/* Q8_0 blocks: {fp16 d, 32 int8 q}, w = d * q. */
static inline __attribute__((always_inline)) void row_dot8_n(
    const float *x, const int rows, int k, int groups, const uint8_t *wrow, float *out, int n,
    int n_total) {
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        const uint8_t *blk = wrow + (size_t)g * Q8_BLOCK_BYTES;
        const __m256 d = _mm256_set1_ps(half_at(blk));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0));
        const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)));
        const __m256 f2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1));
        const __m256 f3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)));
        for (int r = 0; r < rows; ++r) {
            const float *xp = x + (size_t)r * k + (size_t)g * BLOCK;
            __m256 t0 = _mm256_mul_ps(f0, _mm256_loadu_ps(xp));
            __m256 t1 = _mm256_mul_ps(f1, _mm256_loadu_ps(xp + 8));
            t0 = _mm256_fmadd_ps(f2, _mm256_loadu_ps(xp + 16), t0);
            t1 = _mm256_fmadd_ps(f3, _mm256_loadu_ps(xp + 24), t1);
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, acc[r]);
        }
    }
    for (int r = 0; r < rows; ++r) out[(size_t)r * n_total + n] = hsum8(acc[r]);
}

static void row_dot8(const float *x, int rows, int k, int groups, const uint8_t *wrow,
                     float *out, int n, int n_total) {
    switch (rows) {
    case 1: row_dot8_n(x, 1, k, groups, wrow, out, n, n_total); break;
    case 2: row_dot8_n(x, 2, k, groups, wrow, out, n, n_total); break;
    case 3: row_dot8_n(x, 3, k, groups, wrow, out, n, n_total); break;
    case 4: row_dot8_n(x, 4, k, groups, wrow, out, n, n_total); break;
    default: row_dot8_n(x, rows, k, groups, wrow, out, n, n_total); break;
    }
}

static void row_dot(const float *x, const float *xsum, int rows, int k, int groups,
                    const uint8_t *wrow, float *out, int n, int n_total) {
    switch (rows) {
    case 1: row_dot_n(x, xsum, 1, k, groups, wrow, out, n, n_total); break;
    case 2: row_dot_n(x, xsum, 2, k, groups, wrow, out, n, n_total); break;
    case 3: row_dot_n(x, xsum, 3, k, groups, wrow, out, n, n_total); break;
    case 4: row_dot_n(x, xsum, 4, k, groups, wrow, out, n, n_total); break;
    default: row_dot_n(x, xsum, rows, k, groups, wrow, out, n, n_total); break;
    }
}
#else
static inline void row_dot(const float *x, const float *xsum, int rows, int k, int groups,
                           const uint8_t *wrow, float *out, int n, int n_total) {
    for (int r = 0; r < rows; ++r) {
        const float *xr = x + (size_t)r * k;
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) {
            const uint8_t *blk = wrow + (size_t)g * BLOCK_BYTES;
            uint16_t dh, mh;
            memcpy(&dh, blk, 2);
            memcpy(&mh, blk + 2, 2);
            const float *xp = xr + (size_t)g * BLOCK;
            float dot = 0.0f;
            for (int j = 0; j < 16; ++j) {
                dot += (float)(blk[4 + j] & 0x0f) * xp[j];
                dot += (float)(blk[4 + j] >> 4) * xp[j + 16];
            }
            total += fp16_to_f32(dh) * dot + fp16_to_f32(mh) * xsum[(size_t)r * groups + g];
        }
        out[(size_t)r * n_total + n] = total;
    }
}

static void row_dot8(const float *x, int rows, int k, int groups, const uint8_t *wrow,
                     float *out, int n, int n_total) {
    for (int r = 0; r < rows; ++r) {
        const float *xr = x + (size_t)r * k;
        float total = 0.0f;
        for (int g = 0; g < groups; ++g) {
            const uint8_t *blk = wrow + (size_t)g * Q8_BLOCK_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float *xp = xr + (size_t)g * BLOCK;
            float dot = 0.0f;
            for (int j = 0; j < BLOCK; ++j) dot += (float)(int8_t)blk[2 + j] * xp[j];
            total += fp16_to_f32(dh) * dot;
        }
        out[(size_t)r * n_total + n] = total;
    }
}
#endif

int kvf_q4_simd(void) {
#ifdef KVF_SIMD
    return 1;
#else
    return 0;
#endif
}

/* x [rows, k] float32, w [n_total, k / 32] blocks, out [rows, n_total] float32.
 * Returns 0, or -1 when the shapes are outside what the kernel takes (nothing written). */
int kvf_q4_gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out) {
    if (rows < 1 || rows > MAX_ROWS || k < BLOCK || k % BLOCK != 0 || n_total < 1) return -1;
    const int groups = k / BLOCK;
    float *xsum = (float *)malloc(sizeof(float) * (size_t)rows * groups);
    if (xsum == NULL) return -1;
    for (int r = 0; r < rows; ++r)
        for (int g = 0; g < groups; ++g) {
            const float *xp = x + (size_t)r * k + (size_t)g * BLOCK;
            float s = 0.0f;
            for (int j = 0; j < BLOCK; ++j) s += xp[j];
            xsum[(size_t)r * groups + g] = s;
        }
    const size_t row_bytes = (size_t)groups * BLOCK_BYTES;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_total; ++n)
        row_dot(x, xsum, rows, k, groups, w + (size_t)n * row_bytes, out, n, n_total);
    free(xsum);
    return 0;
}

/* The same for Q8_0 blocks ({fp16 d, 32 int8 q}, w = d * q): w [n_total, k / 32 * 34]. */
int kvf_q8_gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out) {
    if (rows < 1 || rows > MAX_ROWS || k < BLOCK || k % BLOCK != 0 || n_total < 1) return -1;
    const int groups = k / BLOCK;
    const size_t row_bytes = (size_t)groups * Q8_BLOCK_BYTES;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_total; ++n)
        row_dot8(x, rows, k, groups, w + (size_t)n * row_bytes, out, n, n_total);
    return 0;
}
