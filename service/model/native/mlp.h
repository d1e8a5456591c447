/* A decoder layer's work after its attention: o, residual, norm, gate/up, act, down and
 * residual, with a family's biases and post-norms (kvf_mlp and the stack's layers).
 * Part of kvf.c (one translation unit). */

static inline const float *float_at(int64_t address) { return (const float *)(intptr_t)address; }

/* rows of x [rows, width] += bias [width] */
static void add_bias(float *x, int rows, int width, const float *bias) {
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < width; ++j) x[(size_t)r * width + j] += bias[j];
}

/* v [dim] = v / sqrt(mean(v^2) + eps) * gamma [dim], as F.rms_norm computes it. */
static void rms_scale(float *v, int dim, const float *gamma, float eps) {
    float ss = 0.0f;
    for (int j = 0; j < dim; ++j) ss += v[j] * v[j];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int j = 0; j < dim; ++j) v[j] = v[j] * inv * gamma[j];
}

/* x [rows, width] += each row of a RMS-normalized and scaled by gamma (a is overwritten). */
static void add_normed(float *x, float *a, int rows, int width, const float *gamma, float eps) {
    for (int r = 0; r < rows; ++r) {
        float *ar = a + (size_t)r * width, *xr = x + (size_t)r * width;
        rms_scale(ar, width, gamma, eps);
        for (int j = 0; j < width; ++j) xr[j] += ar[j];
    }
}

/* The o product of kvf_mlp and its residual add, with what the layer's ``block`` row
 * (B_COLUMNS, or NULL for none) adds: the o bias, and the post-norm (x += rms_norm(product)
 * instead of x += product; the product made in a [rows, hidden]). With the LoRA delta of
 * entry lo (NULL: none) on attn, added after the product. v [rows, max(hidden, inter)], u and
 * span (4 ints a row and 1) scratch. */
static int attn_out(float *x, const float *attn, int rows, int hidden, int q_size,
                    const uint8_t *o, int o_q8, float eps, const int64_t *block, float *a,
                    const int64_t *lo, float *v, float *u, int *span) {
    lora_job job;
    const float *o_bias = block == NULL ? NULL : float_at(block[B_O_BIAS]);
    const float *post_attn = block == NULL ? NULL : float_at(block[B_POST_ATTN]);
    float *o_out = post_attn == NULL ? x : a;
    if (gemv(attn, rows, q_size, o, hidden, o_out, o_q8, GATE_NONE, NULL, 0.0f, post_attn == NULL,
             NULL, 0, 0, lora_for(&job, lo, attn, v, rows, q_size, hidden, NULL, o_out, u, span)) != 0)
        return -1;
    if (o_bias != NULL) add_bias(o_out, rows, hidden, o_bias);
    if (post_attn != NULL) add_normed(x, a, rows, hidden, post_attn, eps);
    return 0;
}

/* The rest of kvf_mlp (norm, gate_up, act, down, residual add), with the layer's gate_up and
 * down biases and MLP post-norm from ``block`` (as attn_out); ``act`` the gate's activation
 * (GATE_SILU or GATE_GELU_TANH). With the LoRA deltas of entries gu and down (each NULL:
 * none) added after their products: gate_up's on the normed x, down's on act(gate) * up. */
static int dense_mlp(float *x, float *h, int rows, int hidden, int inter, const float *gamma,
                     float eps, const uint8_t *gate_up, int gate_up_q8, const uint8_t *down,
                     int down_q8, const int64_t *block, int act, float *a, const int64_t *lgu,
                     const int64_t *ldown, float *v, float *u, int *span) {
    lora_job job;
    const int halves[2] = {inter, 2 * inter};
    const float *gate_up_bias = block == NULL ? NULL : float_at(block[B_GATE_UP_BIAS]);
    const float *down_bias = block == NULL ? NULL : float_at(block[B_DOWN_BIAS]);
    const float *post_mlp = block == NULL ? NULL : float_at(block[B_POST_MLP]);
    if (gemv(x, rows, hidden, gate_up, 2 * inter, h, gate_up_q8, GATE_NONE, gamma, eps, 0, NULL, 0,
             0, lora_for(&job, lgu, NULL, v, rows, hidden, 2 * inter, halves, h, u, span)) != 0)
        return -1;
    if (gate_up_bias != NULL) add_bias(h, rows, 2 * inter, gate_up_bias);
    float *down_out = post_mlp == NULL ? x : a;
    if (gemv(h, rows, inter, down, hidden, down_out, down_q8, act, NULL, 0.0f, post_mlp == NULL,
             NULL, 0, 0, lora_for(&job, ldown, NULL, v, rows, inter, hidden, NULL, down_out, u, span)) != 0)
        return -1;
    if (down_bias != NULL) add_bias(down_out, rows, hidden, down_bias);
    if (post_mlp != NULL) add_normed(x, a, rows, hidden, post_mlp, eps);
    return 0;
}

/* kvf_mlp's three products (attn_out, then dense_mlp). Without a block and with GATE_SILU
 * these are the plain layer's three calls, each product added to x inside its call. */
static int mlp(float *x, const float *attn, float *h, int rows, int hidden, int q_size,
               int inter, const uint8_t *o, int o_q8, const float *gamma, float eps,
               const uint8_t *gate_up, int gate_up_q8, const uint8_t *down, int down_q8,
               const int64_t *block, int act, float *a, const int64_t *lo, const int64_t *lgu,
               const int64_t *ldown, float *v, float *u, int *span) {
    if (attn_out(x, attn, rows, hidden, q_size, o, o_q8, eps, block, a, lo, v, u, span) != 0)
        return -1;
    return dense_mlp(x, h, rows, hidden, inter, gamma, eps, gate_up, gate_up_q8, down, down_q8,
                     block, act, a, lgu, ldown, v, u, span);
}

/* A decoder layer's work between its attention and the next layer's, in one call:
 *   x += attn @ o.T;  h = rms_norm(x, gamma, eps) @ gate_up.T;  x += (silu(h[:, :i]) * h[:, i:]) @ down.T
 * x [rows, hidden] (the residual stream, updated in place), attn [rows, q_size], h [rows, 2i]
 * scratch; o [hidden, q_size], gate_up [2i, hidden] and down [hidden, i] in the row layout (kvf.c)
 * (each 8-bit with its q8 flag). The same arithmetic as the three kvf_gemv calls, one call.
 * Returns 0, or -1 when a shape is outside what the kernel takes (checked first: nothing
 * written), or when scratch memory for a product's input cannot be had (then x may hold
 * the products before it). */
int kvf_mlp(float *x, const float *attn, float *h, int rows, int hidden, int q_size, int inter,
            const uint8_t *o, int o_q8, const float *gamma, float eps, const uint8_t *gate_up,
            int gate_up_q8, const uint8_t *down, int down_q8) {
    const int ks[3] = {q_size, hidden, inter};
    for (int i = 0; i < 3; ++i)
        if (ks[i] < BLOCK || ks[i] % BLOCK != 0 || ks[i] / BLOCK > MAX_GROUPS) return -1;
    if (rows < 1 || rows > MAX_ROWS || hidden < 1 || inter < 1 || gamma == NULL) return -1;
    return mlp(x, attn, h, rows, hidden, q_size, inter, o, o_q8, gamma, eps, gate_up, gate_up_q8,
               down, down_q8, NULL, GATE_SILU, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
}
