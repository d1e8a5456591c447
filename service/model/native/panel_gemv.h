/* A product of weights in the panel layout: which panel kernel runs here, and the call
 * that runs it with a LoRA delta in the same parallel region.
 * Part of kvf.c (one translation unit). */

/* Whether the panel layout runs on SIMD here (else on panel_plain: the same bits, slowly). */
int kvf_panel_simd(void) {
#ifdef KVF_PANEL_SIMD
    return 1;
#else
    return 0;
#endif
}

/* Whether batches of the panel layout run on the tile unit here (the same bits). */
int kvf_panel_amx(void) {
#ifdef KVF_PANEL_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

#ifdef KVF_PANEL_SIMD
/* Rows r0 .. rows - 1 against one panel on AVX512-VNNI, four at a time. */
#define PANEL_ROWS(R, Q8) \
    panel_simd_rows(p, xb, plane, r, R, k, groups, panel, out, n0, n_total, Q8)
static void panel_simd_all(const prepared_x *p, const uint8_t *xb, size_t plane, int r0, int rows,
                           int k, int groups, const uint8_t *panel, float *out, int n0, int n_total,
                           int q8) {
    int r = r0;
    for (; r + 4 <= rows; r += 4) {
        if (q8) PANEL_ROWS(4, 1);
        else PANEL_ROWS(4, 0);
    }
    switch ((rows - r) * 2 + q8) {
    case 7: PANEL_ROWS(3, 1); break;
    case 6: PANEL_ROWS(3, 0); break;
    case 5: PANEL_ROWS(2, 1); break;
    case 4: PANEL_ROWS(2, 0); break;
    case 3: PANEL_ROWS(1, 1); break;
    case 2: PANEL_ROWS(1, 0); break;
    default: break;
    }
}
#undef PANEL_ROWS
#endif

/* A LoRA delta's planned work (lora_plan in lora.h gives its arithmetic). */
typedef struct lora_job lora_job;
struct lora_job {
    const float *in, *mask; /* in NULL: the base product's prepared input, once it has one */
    const void *a, *bt;
    const int *ends;
    float *out, *u, *spare; /* spare [rows, k]: the input made here where the base has none */
    int *span, *order, *starts;
    int rows, k, n, held, ranks, parts, groups, blocks;
    size_t work; /* multiply-adds */
};

static void lora_prefetch(const lora_job *job);
static void lora_products(const lora_job *job);
static int lora_parallel(const lora_job *job);

/* out [rows, n_total] (= or += with p->accumulate) for weights w in the panel layout, then,
 * with job (else NULL), out += its LoRA delta, both in one parallel region: the delta's
 * weights asked for first, its products after the panels.
 * Returns 0, or -1 without scratch memory (nothing written). */
static int panel_gemv(const prepared_x *p, int rows, int k, const uint8_t *w, int n_total,
                      float *out, int q8, const lora_job *job) {
    const int groups = k / BLOCK, panels = n_total / PANEL;
    const int parallel = (size_t)n_total * groups >= 2048 || (job != NULL && lora_parallel(job));
    const size_t bytes = panel_bytes(q8);
#ifdef KVF_PANEL_SIMD
    const size_t plane = (size_t)((rows + 15) & ~15) * k;
    uint8_t *xb = (uint8_t *)thread_buffer(SCRATCH_PANEL,
                                           2 * plane + sizeof(int32_t) * (size_t)rows * groups);
    if (xb == NULL) return -1;
    panel_split(p, rows, k, xb, plane);
#endif
#ifdef KVF_PANEL_AMX
    if (rows >= PANEL_AMX_MIN_ROWS && amx_permitted()) {
        int no_memory = 0;
#pragma omp parallel if (parallel) reduction(| : no_memory)
        {
            if (job != NULL) lora_prefetch(job);
            /* dm (floats, 64-byte aligned) first, then the unpacked 4-bit codes, then xst */
            const size_t unpacked = (size_t)PANEL_CHUNK * groups * (q8 ? 0 : 512);
            float *dm = (float *)thread_buffer(SCRATCH_PANEL_CODES,
                                               (size_t)PANEL_CHUNK * groups * 128 + unpacked +
                                                   sizeof(float) * 16 * (size_t)groups);
            uint8_t *wb = (uint8_t *)(dm + (size_t)PANEL_CHUNK * 32 * groups);
            no_memory = dm == NULL;
            panel_amx_configure();
            int lo, hi;
            thread_share(panels, &lo, &hi);
            if (!no_memory)
                panel_chunks(p, xb, plane, rows, k, w, lo, hi, q8, dm, wb,
                             (float *)(wb + unpacked), out, n_total);
            _tile_release();
            if (job != NULL) lora_products(job);
        }
        return no_memory ? -1 : 0;
    }
#endif
#pragma omp parallel if (parallel)
    {
        if (job != NULL) lora_prefetch(job);
#pragma omp for schedule(static) nowait
        for (int q = 0; q < panels; ++q) {
            const uint8_t *panel = w + (size_t)q * groups * bytes;
#ifdef KVF_PANEL_SIMD
            panel_simd_all(p, xb, plane, 0, rows, k, groups, panel, out, q * PANEL, n_total, q8);
#else
            panel_plain(p, 0, rows, k, groups, panel, out, q * PANEL, n_total, q8);
#endif
        }
        if (job != NULL) lora_products(job);
    }
    return 0;
}
/* ---- end of the panels ---- */
