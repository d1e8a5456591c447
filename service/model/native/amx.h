/* The tile unit (AMX) for batches of the row layouts: weights unpacked to bf16 and
 * multiplied with x in bf16, accumulating in float32.
 * Part of kvf.c (one translation unit). */

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
