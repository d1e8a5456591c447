/* The 4-bit row layout (Q4_0, Q4_1; Q4_K as the wide layout): W weight rows at a time
 * for each row of x, w = d * q + m.
 * Part of kvf.c (one translation unit). */

#ifdef KVF_SIMD
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
#endif
