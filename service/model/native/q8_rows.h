/* The 8-bit row layout (Q8_0; Q6_K as the wide layout): W weight rows at a time for
 * each row of x, w = d * q.
 * Part of kvf.c (one translation unit). */

#ifdef KVF_SIMD
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
#endif
