/* LoRA's inner loops: an adapter's weights as held (float32, bf16, fp16) against LORA_GROUP
 * rows at a time, the A dots and the B rank sums.
 * Part of kvf.c (one translation unit). */

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
