/* A call's walk over the row layouts' output rows: TILE rows of x a pass for batches, the
 * one-row loops (q4_rows.h, q8_rows.h) otherwise, and the plain C path without SIMD.
 * Part of kvf.c (one translation unit). */

#ifdef KVF_SIMD
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
