/* The panel layout (batch-invariant steps) and its per-row kernels: plain C and
 * AVX512-VNNI, the same bits in a batch of any size.
 * Part of kvf.c (one translation unit). */

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
