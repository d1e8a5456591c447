/* The row layouts' shared SIMD steps: block unpacking, the exact int16 dot product of a
 * block, and the scale vectors every row loop (q4_rows.h, q8_rows.h, row_loop.h) reads.
 * Part of kvf.c (one translation unit). */

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

#endif
