/* The GEMV entry (kvf_gemv) and the tier queries: each call goes to the tile unit, the
 * panels or the row loops, then adds its LoRA delta and turns RoPE.
 * Part of kvf.c (one translation unit). */

/* Whether batches can take the tile path (built for and allowed on this CPU). */
int kvf_amx(void) {
#ifdef KVF_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* The smallest batch that takes the tile path (0 where there is none). */
int kvf_amx_min_rows(void) {
#ifdef KVF_AMX
    return AMX_MIN_ROWS;
#else
    return 0;
#endif
}

int kvf_q4_simd(void) {
#ifdef KVF_SIMD
    return 1;
#else
    return 0;
#endif
}

int kvf_q4_max_k(void) { return MAX_GROUPS * BLOCK; }

/* RoPE on the first heads * dim columns of each row of out [rows, n_total] (the q and k
 * heads of a fused qkv projection): with c, s = table[r, 0], table[r, 1] ([rows, 2, dim]:
 * cos, and sin with its first half negated, as LlamaModel.rope holds them),
 * y[j] = x[j] * c[j] + x[j +- dim/2] * s[j] (rotate_half folded into the sign of s). */
static void rope_rows(float *out, int rows, int n_total, int heads, int dim, const float *table) {
    const int half = dim / 2;
    for (int r = 0; r < rows; ++r) {
        const float *c = table + (size_t)r * 2 * dim, *sn = c + dim;
        for (int h = 0; h < heads; ++h) {
            float *x = out + (size_t)r * n_total + (size_t)h * dim;
            for (int j = 0; j < half; ++j) {
                const float lo = x[j], hi = x[j + half];
                x[j] = lo * c[j] + hi * sn[j];
                x[j + half] = hi * c[j + half] + lo * sn[j + half];
            }
        }
    }
}

/* out [rows, n_total] = input @ w.T, float32, or with ``accumulate`` out += input @ w.T.
 * The input is x [rows, k] float32, or with ``gated`` x [rows, 2k] and
 * input = silu(x[:, :k]) * x[:, k:]; with ``gamma`` [k] (else NULL) the input is then
 * RMS-normalized (eps) and scaled by gamma. w [n_total, row bytes] (the row layout in kvf.c). With
 * ``rope`` [rows, 2, rope_dim] (else NULL), rope_rows then rotates the first rope_heads
 * heads of each output row. Returns 0, or -1 when the shapes are outside what the kernel
 * takes (nothing written). */
static int gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out,
                int q8, int gated, const float *gamma, float eps, int accumulate,
                const float *rope, int rope_heads, int rope_dim, lora_job *job);

int kvf_gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out,
             int q8, int gated, const float *gamma, float eps, int accumulate,
             const float *rope, int rope_heads, int rope_dim) {
    return gemv(x, rows, k, w, n_total, out, q8, gated, gamma, eps, accumulate, rope, rope_heads,
                rope_dim, NULL);
}

static inline void lora_run(const lora_job *job);
static inline void lora_input(lora_job *job, const float *x, int gated, const float *gamma,
                              float eps);

/* kvf_gemv, then (job, else NULL) out += its LoRA delta before the rotation: in the
 * projection's own parallel region where the weights are in the panel layout. A job
 * without an input takes the product's (x after its gate and norm, as prepare makes it). */
static int gemv(const float *x, int rows, int k, const uint8_t *w, int n_total, float *out,
                int q8, int gated, const float *gamma, float eps, int accumulate,
                const float *rope, int rope_heads, int rope_dim, lora_job *job) {
    if (rows < 1 || rows > MAX_ROWS || k < BLOCK || k % BLOCK != 0 || k / BLOCK > MAX_GROUPS ||
        n_total < 1 || gated < GATE_NONE || gated >= GATE_KINDS)
        return -1;
    if (rope != NULL && (accumulate || rope_heads < 1 || rope_dim < 2 || rope_dim % 2 != 0 ||
                         (int64_t)rope_heads * rope_dim > n_total))
        return -1;
    const int may_tile = (q8 & KVF_TILES) != 0, panels = (q8 & KVF_PANELS) != 0;
    const int wide = (q8 & KVF_WIDE) != 0;
    q8 &= 1;
    if (panels && (n_total % PANEL != 0 || wide)) return -1;
    const int groups = k / BLOCK;
    const size_t padded = (size_t)((groups + 7) & ~7);
    const size_t row_bytes = wide ? (size_t)groups * (q8 ? 32 : 16) + 8 * padded
                             : q8 ? (size_t)groups * 32 + 2 * padded
                                  : (size_t)groups * 16 + 4 * padded;
    if (panels) {
        prepared_x p;
        if (prepare(x, rows, k, gated, gamma, eps, &p) != 0) return -1;
        p.accumulate = accumulate;
        if (job != NULL && job->in == NULL) job->in = p.x;
        if (panel_gemv(&p, rows, k, w, n_total, out, q8, job) != 0) return -1;
        if (rope != NULL) rope_rows(out, rows, n_total, rope_heads, rope_dim, rope);
        return 0;
    }
#ifdef KVF_AMX
    if (may_tile && !wide &&
        amx_gemv(x, rows, k, w, n_total, out, q8, gated, gamma, eps, accumulate, row_bytes) == 0) {
        if (job != NULL) {
            lora_input(job, x, gated, gamma, eps);
            lora_run(job);
        }
        if (rope != NULL) rope_rows(out, rows, n_total, rope_heads, rope_dim, rope);
        return 0;
    }
#else
    (void)may_tile;
#endif
    prepared_x p;
    if (prepare(x, rows, k, gated, gamma, eps, &p) != 0) return -1;
    p.accumulate = accumulate;
    if (job != NULL && job->in == NULL) job->in = p.x;
#ifdef KVF_SIMD
    const int quads = (n_total + 3) / 4;
    /* below ~2,000 blocks the threads' start-up costs more than they save */
    int no_memory = 0;
#pragma omp parallel if ((size_t)n_total * groups >= 2048 || (job != NULL && lora_parallel(job))) \
    reduction(| : no_memory)
    {
        if (job != NULL) lora_prefetch(job);
        /* each worker's weight-scale tables (thread_steps), on the heap */
        no_memory = thread_buffer(SCRATCH_STEPS, sizeof(float) * STEP_FLOATS) == NULL;
#pragma omp for schedule(static) nowait
        for (int i = 0; i < quads; ++i) {
            const int n = 4 * i, count = n_total - n < 4 ? n_total - n : 4;
            if (!no_memory)
                row_blocks(&p, rows, k, groups, w, row_bytes, out, n, n_total, count, q8, wide);
        }
        if (job != NULL) lora_products(job);
    }
    if (no_memory) return -1;
#else
#pragma omp parallel for schedule(static)
    for (int n = 0; n < n_total; ++n) {
        if (q8) row_q8(&p, rows, k, groups, w + (size_t)n * row_bytes, out, n, n_total, wide);
        else row_q4(&p, rows, k, groups, w + (size_t)n * row_bytes, out, n, n_total, wide);
    }
    if (job != NULL) lora_run(job);
#endif
    if (rope != NULL) rope_rows(out, rows, n_total, rope_heads, rope_dim, rope);
    return 0;
}
