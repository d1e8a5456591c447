/* The panel layout's batches on the tile unit (AMX int8): the same bits as panels.h.
 * Part of kvf.c (one translation unit). */

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
