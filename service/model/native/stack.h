/* The decoder stack (kvf_decoder_stack): a whole decode forward's layers in one call.
 * Part of kvf.c (one translation unit). */

/* A whole decode forward's decoder layers in one call, for rows tokens of rows sequences:
 * per layer l, the same calls the layer-by-layer path makes,
 *   qkv = rms_norm(x, attn_norm) @ qkv.T, plus the bias, each q and k head normed
 *         (blocks' B_QKV_BIAS, B_QK_NORM; each where the layer has it), RoPE on the q and k
 *         heads by the layer's table (B_ROPE of rope_tables tables of [rows, 2, dim] one
 *         after another in rope), q times query_scale;
 *   out = attend(ctx, l, q, k, v)        kvcache's write and attention;
 *   mlp(x, out, ...)                     o, residual, norm, gate/up, act, down, residual,
 *                                        with the layer's biases and post-norms; where the
 *                                        block row names experts, the o half and then
 *                                        experts_mlp (router, top-k, each picked expert).
 * x [rows, hidden] float32, updated in place; table [layers, T_COLUMNS]; blocks [layers,
 * B_COLUMNS] or NULL (the plain Llama layer: none of them, RoPE table 0); act the MLP gate's
 * activation (GATE_SILU, GATE_GELU_TANH). With lora [layers, G_COUNT, L_COLUMNS] (else NULL)
 * each projection with an entry also adds its rows' LoRA delta (lora_plan) where the layer
 * loop adds it: qkv's on the normed x before the bias, o's on the attention output,
 * gate_up's on the normed x, down's on act(gate) * up.
 * Returns 0; -1 when a shape is outside what the kernel takes (found before anything is
 * written: every layer has the same shapes) or scratch memory cannot be had; -2 when attend
 * refused a layer (it wrote nothing for it, and x holds that layer's input).
 * NOTE: measured on a 2-core AVX2 EPYC, SmolLM2-135M at B=1: the Python layer loop around
 * the same three calls a layer (views, copies, checks) cost ~2 ms a step. */
int kvf_decoder_stack(float *x, int rows, int hidden, int layers, const int64_t *table,
                      const int64_t *blocks, int q_heads, int kv_heads, int dim, int inter,
                      float eps, int act, float query_scale, const float *rope, int rope_tables,
                      attend_fn attend, const void *ctx, const int64_t *lora) {
    const int q_size = q_heads * dim, kv_size = kv_heads * dim, n_qkv = q_size + 2 * kv_size;
    const int ks[3] = {hidden, q_size, inter};
    for (int i = 0; i < 3; ++i)
        if (ks[i] < BLOCK || ks[i] % BLOCK != 0 || ks[i] / BLOCK > MAX_GROUPS) return -1;
    if (rows < 1 || rows > MAX_ROWS || layers < 1 || q_heads < 1 || kv_heads < 1 || dim < 2 ||
        dim % 2 != 0 || inter < 1 || rope == NULL || attend == NULL || table == NULL ||
        rope_tables < 1 || (act != GATE_SILU && act != GATE_GELU_TANH) || !isfinite(query_scale))
        return -1;
    for (int l = 0; blocks != NULL && l < layers; ++l) {
        const int64_t *b = blocks + (size_t)l * B_COLUMNS;
        if (b[B_ROPE] < 0 || b[B_ROPE] >= rope_tables) return -1;
        if (!experts_ok(b, lora_entry(lora, l, G_GATE_UP), lora_entry(lora, l, G_DOWN))) return -1;
    }
    const size_t r = (size_t)rows;
    const int qkv_ends[3] = {q_size, q_size + kv_size, n_qkv};
    int64_t max_ranks = 0;
    for (size_t e = 0; lora != NULL && e < (size_t)layers * G_COUNT; ++e) {
        const int64_t *g = lora + e * L_COLUMNS;
        if (g[L_RANKS] < 0 || g[L_RANKS] > LORA_MAX_RANKS) return -1;
        if (g[L_RANKS] == 0) continue; /* no delta on this projection: the rest is unread */
        if (g[L_A] == 0 || g[L_B] == 0 || g[L_MASK] == 0) return -1;
        /* only qkv (q|k|v) and gate_up (gate|up) are block-diagonal by module */
        const int most = e % G_COUNT == G_QKV ? 3 : e % G_COUNT == G_GATE_UP ? 2 : 1;
        if (g[L_PARTS] != 1 && g[L_PARTS] != most) return -1;
        if (g[L_HELD] < 0 || g[L_HELD] >= HELD_KINDS) return -1;
        if (g[L_RANKS] > max_ranks) max_ranks = g[L_RANKS];
    }
    /* qkv, then q, k, v (contiguous per head block), attention output, gate/up, a product's
     * rows before their post-norm, and an expert row's normed input and sum (experts_mlp) */
    float *buf = malloc(sizeof(float) *
                        (r * ((size_t)n_qkv * 2 + q_size + 2 * (size_t)inter + (size_t)hidden) +
                         2 * (size_t)hidden));
    if (buf == NULL) return -1;
    /* with deltas: a product's normed or gated input [rows, max(hidden, inter)], u, span */
    const size_t wide = (size_t)(hidden > inter ? hidden : inter);
    float *lbuf = NULL;
    if (max_ranks > 0) {
        lbuf = malloc(sizeof(float) * r * (wide + (size_t)max_ranks) + sizeof(int) * (4 * r + 1));
        if (lbuf == NULL) {
            free(buf);
            return -1;
        }
    }
    float *lv = lbuf, *lu = lbuf == NULL ? NULL : lbuf + r * wide;
    int *span = lbuf == NULL ? NULL : (int *)(lu + r * (size_t)max_ranks);
    float *qkv = buf, *q = qkv + r * n_qkv, *k = q + r * q_size, *v = k + r * kv_size;
    float *out = v + r * kv_size, *h = out + r * q_size, *a = h + r * 2 * (size_t)inter;
    float *moe = a + r * (size_t)hidden;
    int status = 0;
    for (int l = 0; l < layers && status == 0; ++l) {
        const int64_t *t = table + (size_t)l * T_COLUMNS;
        const int64_t *b = blocks == NULL ? NULL : blocks + (size_t)l * B_COLUMNS;
        const float *attn_norm = float_at(t[T_ATTN_NORM]);
        const float *qkv_bias = b == NULL ? NULL : float_at(b[B_QKV_BIAS]);
        const float *qk_norm = b == NULL ? NULL : float_at(b[B_QK_NORM]);
        const float *turn = rope + (size_t)(b == NULL ? 0 : b[B_ROPE]) * r * 2 * (size_t)dim;
        /* RoPE in the product's call, or after the bias and head norms where there are some */
        const int after = qkv_bias != NULL || qk_norm != NULL;
        const int64_t *dq = lora_entry(lora, l, G_QKV), *dout = lora_entry(lora, l, G_O);
        const int64_t *dgu = lora_entry(lora, l, G_GATE_UP), *ddown = lora_entry(lora, l, G_DOWN);
        /* the delta goes in before RoPE: the product, then the delta, then RoPE */
        lora_job job;
        if (gemv(x, rows, hidden, (const uint8_t *)(intptr_t)t[T_QKV], n_qkv, qkv,
                 (int)t[T_QKV_Q8], GATE_NONE, attn_norm, eps, 0, after ? NULL : turn,
                 q_heads + kv_heads, dim,
                 lora_for(&job, dq, NULL, lv, rows, hidden, n_qkv, qkv_ends, qkv, lu, span)) != 0) {
            status = -1;
            break;
        }
        if (qkv_bias != NULL) add_bias(qkv, rows, n_qkv, qkv_bias);
        for (size_t i = 0; qk_norm != NULL && i < r; ++i)
            for (int hd = 0; hd < q_heads + kv_heads; ++hd)
                rms_scale(qkv + i * n_qkv + (size_t)hd * dim, dim, qk_norm + (size_t)hd * dim, eps);
        if (after) rope_rows(qkv, rows, n_qkv, q_heads + kv_heads, dim, turn);
        for (size_t i = 0; i < r; ++i) {
            const float *src = qkv + i * n_qkv;
            memcpy(q + i * q_size, src, sizeof(float) * q_size);
            memcpy(k + i * kv_size, src + q_size, sizeof(float) * kv_size);
            memcpy(v + i * kv_size, src + q_size + kv_size, sizeof(float) * kv_size);
        }
        if (query_scale != 1.0f)
            for (size_t i = 0; i < r * (size_t)q_size; ++i) q[i] *= query_scale;
        if (attend(ctx, l, q, k, v, out) != 0) {
            status = -2;
            break;
        }
        status = attn_out(x, out, rows, hidden, q_size, (const uint8_t *)(intptr_t)t[T_O],
                          (int)t[T_O_Q8], eps, b, a, dout, lv, lu, span);
        if (status != 0) break;
        if (b != NULL && b[B_EXPERTS] != 0)
            status = experts_mlp(x, rows, hidden, inter, float_at(t[T_MLP_NORM]), eps, b, act, h,
                                 a, moe);
        else
            status = dense_mlp(x, h, rows, hidden, inter, float_at(t[T_MLP_NORM]), eps,
                               (const uint8_t *)(intptr_t)t[T_GATE_UP], (int)t[T_GATE_UP_Q8],
                               (const uint8_t *)(intptr_t)t[T_DOWN], (int)t[T_DOWN_Q8], b, act, a,
                               dgu, ddown, lv, lu, span);
    }
    free(lbuf);
    free(buf);
    return status;
}
