/* The mixture-of-experts block: a row's routing (router, softmax, top-k) and the picked
 * experts' MLPs in place of the dense one.
 * Part of kvf.c (one translation unit). */

/* Row hn [hidden]'s routing, as service.model.moe.route computes it: float32 logits
 * (hn @ router.T, router [count, hidden]), their softmax, the top_k largest probabilities
 * (ties to the lower expert, as torch.topk picks them), with normalize divided by their sum
 * (taken in rank order). Answers in weight [count] each expert's weight, 0 for those not
 * picked; picked [count] 1 for the picked. */
static void route(const float *hn, int hidden, const float *router, int count, int top_k,
                  int normalize, float *weight, unsigned char *picked) {
    float top = -INFINITY, sum = 0.0f;
    for (int e = 0; e < count; ++e) {
        const float *w = router + (size_t)e * hidden;
        float s = 0.0f;
        for (int j = 0; j < hidden; ++j) s += hn[j] * w[j];
        weight[e] = s;
        picked[e] = 0;
        if (s > top) top = s;
    }
    for (int e = 0; e < count; ++e) {
        weight[e] = expf(weight[e] - top);
        sum += weight[e];
    }
    const float inv = 1.0f / sum;
    for (int e = 0; e < count; ++e) weight[e] *= inv;
    int rank[MAX_EXPERTS];
    float kept = 0.0f;
    for (int k = 0; k < top_k; ++k) {
        int best = -1;
        for (int e = 0; e < count; ++e) /* strictly larger: a tie keeps the lower expert */
            if (!picked[e] && (best < 0 || weight[e] > weight[best])) best = e;
        picked[best] = 1;
        rank[k] = best;
        kept += weight[best];
    }
    for (int e = 0; e < count; ++e)
        if (!picked[e]) weight[e] = 0.0f;
    for (int k = 0; normalize && k < top_k; ++k) weight[rank[k]] /= kept;
}

/* A mixture-of-experts MLP (the layer's block row: B_ROUTER, B_EXPERTS, ...) in place of
 * dense_mlp, each row on its own: its normed input (gamma), its routing (route), then for each
 * picked expert in expert order its gate_up product, act(gate) * up into its down product,
 * and m += weight * that (m from 0), then x += m (or its post-norm, B_POST_MLP). A row's
 * arithmetic is the same whichever rows are beside it; experts add in index order, as
 * moe_mlp's index_add_ over its expert-sorted assignments does. h [2 inter], a [hidden] and
 * moe [2 hidden] scratch. */
static int experts_mlp(float *x, int rows, int hidden, int inter, const float *gamma, float eps,
                       const int64_t *block, int act, float *h, float *a, float *moe) {
    const int count = (int)block[B_EXPERT_COUNT], top_k = (int)block[B_TOP_K];
    const float *router = float_at(block[B_ROUTER]);
    const int64_t *experts = (const int64_t *)(intptr_t)block[B_EXPERTS];
    const float *post_mlp = float_at(block[B_POST_MLP]);
    float *hn = moe, *m = moe + hidden;
    float weight[MAX_EXPERTS];
    unsigned char picked[MAX_EXPERTS];
    for (int r = 0; r < rows; ++r) {
        float *xr = x + (size_t)r * hidden;
        input_row(xr, hidden, GATE_NONE, gamma, eps, hn);
        route(hn, hidden, router, count, top_k, (int)block[B_NORM_TOP_K], weight, picked);
        memset(m, 0, sizeof(float) * (size_t)hidden);
        for (int e = 0; e < count; ++e) {
            if (!picked[e]) continue;
            const int64_t *ex = experts + (size_t)e * E_COLUMNS;
            if (gemv(hn, 1, hidden, (const uint8_t *)(intptr_t)ex[E_GATE_UP], 2 * inter, h,
                     (int)ex[E_GATE_UP_Q8], GATE_NONE, NULL, 0.0f, 0, NULL, 0, 0, NULL) != 0 ||
                gemv(h, 1, inter, (const uint8_t *)(intptr_t)ex[E_DOWN], hidden, a,
                     (int)ex[E_DOWN_Q8], act, NULL, 0.0f, 0, NULL, 0, 0, NULL) != 0)
                return -1;
            const float w = weight[e];
            for (int j = 0; j < hidden; ++j) m[j] += w * a[j];
        }
        if (post_mlp == NULL)
            for (int j = 0; j < hidden; ++j) xr[j] += m[j];
        else
            add_normed(xr, m, 1, hidden, post_mlp, eps);
    }
    return 0;
}

/* Whether layer block b's experts (if any) are ones kvf_decoder_stack takes: a count of 1 to
 * MAX_EXPERTS, top_k of 1 to count, a router and every expert's weights, and no dense MLP
 * biases or gate_up/down LoRA deltas (lgu, ldown) beside them. */
static int experts_ok(const int64_t *b, const int64_t *lgu, const int64_t *ldown) {
    if (b == NULL || b[B_EXPERTS] == 0) return 1;
    const int64_t count = b[B_EXPERT_COUNT], top_k = b[B_TOP_K];
    if (count < 1 || count > MAX_EXPERTS || top_k < 1 || top_k > count || b[B_ROUTER] == 0 ||
        b[B_GATE_UP_BIAS] != 0 || b[B_DOWN_BIAS] != 0 || lgu != NULL || ldown != NULL)
        return 0;
    const int64_t *experts = (const int64_t *)(intptr_t)b[B_EXPERTS];
    for (int64_t e = 0; e < count; ++e)
        if (experts[e * E_COLUMNS + E_GATE_UP] == 0 || experts[e * E_COLUMNS + E_DOWN] == 0)
            return 0;
    return 1;
}
