/* LoRA deltas of a step's rows: the plan (each row's rank span, groups, output blocks),
 * the two products on the region's threads, and the stack's LoRA table.
 * Part of kvf.c (one translation unit). */

/* below this many multiply-adds a LoRA delta runs on one thread
 * NOTE: measured on a 2-core AMX Xeon, SmolLM2-135M's shapes with rank-16 deltas on all seven
 * projections, one row, 30 layers' deltas (20 MB of float32 A and B): 0.69-0.77 ms with both
 * products of a delta in one parallel region from 4,096 multiply-adds (every delta of this
 * model on both threads) against 0.85-0.98 ms with a region a product from 32,768 (most
 * deltas on one thread). */
#define LORA_PARALLEL 4096

/* outputs a thread's share of the B product takes at a time (a block never crosses a module) */
#define LORA_BLOCK 128

/* out [rows, n] += ((in [rows, k] @ a.T) * mask) @ bt: one LoRA delta of a step's rows,
 * a [ranks, k] and bt [ranks, n] the step's adapters' weights stacked along the rank axis
 * (held as HELD_F32, HELD_BF16 or HELD_F16), mask [rows, ranks] each row's own adapter's ranks
 * (its scale) and 0 elsewhere.
 * Rank columns a row's mask zeroes are never computed, and a row with no nonzero mask
 * (a base row) gets nothing added: its values stay bit for bit the base projection's.
 * Rows with the same mask span (one adapter's) go through its weights together, up to
 * LORA_GROUP at once; each output still adds its row's ranks in rank order, whatever the
 * rows, their grouping, the threads or the output's place in its block: a row's delta does
 * not depend on the step it is in.
 * With parts > 1, bt is block-diagonal by module, as a fused projection's adapters are built
 * (service/model/lora.py): the outputs stack parts modules, module j's ending at ends[j]
 * (ends[parts - 1] = n), each adapter's rank block stacks one rank slice per module in the
 * same order, and module j's outputs have nonzero bt only in the j-th slice; a row whose mask
 * span divides into parts slices then reads only its module's slice (the other products are 0).
 * u [rows, ranks] and span (4 ints a row and 1) are scratch.
 * A job is planned once (lora_plan); its two products are split over the threads of
 * whichever parallel region calls them (lora_products: lora_ranks, then lora_outputs once
 * every thread's lora_ranks is done), the base projection's own (gemv) or lora_run's. */

/* Where module m of a job's outputs starts and stops. */
static inline void module_outputs(const lora_job *job, int m, int *from, int *stop) {
    *from = m == 0 ? 0 : job->ends[m - 1];
    *stop = job->parts > 1 ? job->ends[m] : job->n;
}

/* How many output blocks module m of a job has (a block never crosses a module). */
static inline int module_blocks(const lora_job *job, int m) {
    int from, stop;
    module_outputs(job, m, &from, &stop);
    return (stop - from + LORA_BLOCK - 1) / LORA_BLOCK;
}

/* Plans job for the arguments above: each row's span, the rows' groups, the output blocks. */
static void lora_plan(lora_job *job, const float *in, float *spare, int rows, int k,
                      const void *a, const void *bt, int held, const float *mask, int ranks,
                      int n, int parts, const int *ends, float *out, float *u, int *span) {
    /* span: each row's [lo, hi), then the rows with a nonzero span ordered by it, then where
     * each group of them (up to LORA_GROUP rows of one span) starts in that order */
    int *order = span + 2 * rows, *starts = order + rows, live = 0, groups = 0;
    for (int r = 0; r < rows; ++r) {
        const float *mr = mask + (size_t)r * ranks;
        int lo = 0, hi = ranks;
        while (lo < ranks && mr[lo] == 0.0f) ++lo;
        while (hi > lo && mr[hi - 1] == 0.0f) --hi;
        span[2 * r] = lo;
        span[2 * r + 1] = hi;
        if (lo >= hi) continue;
        int at = live++;
        for (; at > 0 && span[2 * order[at - 1]] > lo; --at) order[at] = order[at - 1];
        order[at] = r;
    }
    /* a group ends where the span changes or it holds LORA_GROUP rows */
    for (int g = 0; g < live; ++g) {
        const int *first = groups > 0 ? span + 2 * order[starts[groups - 1]] : NULL;
        const int *here = span + 2 * order[g];
        if (first == NULL || g - starts[groups - 1] == LORA_GROUP || here[0] != first[0] ||
            here[1] != first[1])
            starts[groups++] = g;
    }
    starts[groups] = live;
    *job = (lora_job){in, mask, a, bt, parts > 1 ? ends : NULL, out, u, spare, span, order, starts,
                      rows, k, n, held, ranks, parts, groups, 0,
                      (size_t)live * ranks * ((size_t)k + n)};
    for (int m = 0; m < parts; ++m) job->blocks += module_blocks(job, m);
}

/* Output block blk of a job: its module and first output, and how many outputs it has. */
static inline void output_block(const lora_job *job, int blk, int *module, int *i0, int *count) {
    int m = 0, left = blk;
    for (; left >= module_blocks(job, m); ++m) left -= module_blocks(job, m);
    int from, stop;
    module_outputs(job, m, &from, &stop);
    *module = m;
    *i0 = from + left * LORA_BLOCK;
    *count = stop - *i0 < LORA_BLOCK ? stop - *i0 : LORA_BLOCK;
}

/* Group t's ranks [lo, hi) that output module m reads. */
static inline void group_module_ranks(const lora_job *job, int t, int m, int *lo, int *hi) {
    const int *first = job->span + 2 * job->order[job->starts[t]];
    *lo = first[0];
    *hi = first[1];
    if (job->parts > 1 && (*hi - *lo) % job->parts == 0) {
        const int slice = (*hi - *lo) / job->parts;
        *lo += m * slice;
        *hi = *lo + slice;
    }
}

/* Whether group t reads the same ranks as the group before it (one adapter's rows past
 * LORA_GROUP): its weights are already on their way. */
static inline int same_span_as_previous(const lora_job *job, int t) {
    if (t == 0) return 0;
    const int *a = job->span + 2 * job->order[job->starts[t - 1]];
    const int *b = job->span + 2 * job->order[job->starts[t]];
    return a[0] == b[0] && a[1] == b[1];
}

static inline void prefetch_bytes(const char *p, size_t bytes) {
    for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

/* Asks for this thread's shares of the job's weights (lora_ranks's and lora_outputs's) to be
 * brought towards its core, for the time the base projection's panels take.
 * NOTE: measured on the 2-core AMX Xeon, SmolLM2-135M, rank-16 bfloat16 adapters on all seven
 * projections, both builds in one process taking turns: 16 decode rows over 4 adapters
 * (~40 MB of A and B a step) took 0.44 ms a step less with these prefetches (15 of 16
 * rounds faster); one row was unchanged within the host's noise. */
static void lora_prefetch(const lora_job *job) {
    const size_t elem = held_bytes(job->held);
    int lo, hi;
    thread_share((job->ranks + 1) / 2, &lo, &hi);
    for (int t = 0; t < job->groups; ++t) {
        if (same_span_as_previous(job, t)) continue;
        const int *first = job->span + 2 * job->order[job->starts[t]];
        const int j = 2 * lo > first[0] ? 2 * lo : first[0];
        const int end = 2 * hi < first[1] ? 2 * hi : first[1];
        if (j < end)
            prefetch_bytes((const char *)job->a + (size_t)j * job->k * elem,
                           (size_t)(end - j) * job->k * elem);
    }
    thread_share(job->blocks, &lo, &hi);
    for (int blk = lo; blk < hi; ++blk) {
        int module, i0, count;
        output_block(job, blk, &module, &i0, &count);
        for (int t = 0; t < job->groups; ++t) {
            if (same_span_as_previous(job, t)) continue;
            int rlo, rhi;
            group_module_ranks(job, t, module, &rlo, &rhi);
            for (int j = rlo; j < rhi; ++j)
                prefetch_bytes((const char *)job->bt + ((size_t)j * job->n + i0) * elem,
                               (size_t)count * elem);
        }
    }
}

/* u = (in @ a.T) * mask for the job's rows and ranks, two ranks at a time: this thread's
 * share of the pairs (thread_share; lora_outputs may start once every thread is done). */
static void lora_ranks(const lora_job *job) {
    const int *span = job->span, *order = job->order, *starts = job->starts;
    const int ranks = job->ranks, k = job->k, held = job->held;
    const size_t elem = held_bytes(held);
    int from, to;
    thread_share((ranks + 1) / 2, &from, &to);
    for (int pair = from; pair < to; ++pair) {
        for (int t = 0; t < job->groups; ++t) {
            const int *idx = order + starts[t], nr = starts[t + 1] - starts[t];
            const int lo = span[2 * idx[0]], hi = span[2 * idx[0] + 1];
            /* the pair's ranks inside the group's span: [j, end) */
            int j = 2 * pair, end = j + 2 < ranks ? j + 2 : ranks;
            if (j < lo) j = lo;
            if (end > hi) end = hi;
            if (j >= end) continue;
            const int nw = end - j;
            const float *x[LORA_GROUP];
            for (int q = 0; q < nr; ++q) x[q] = job->in + (size_t)idx[q] * k;
            float dots[2][LORA_GROUP];
            dots_group(x, nr, (const char *)job->a + (size_t)j * k * elem, nw, k, held, dots);
            for (int p = 0; p < nw; ++p)
                for (int q = 0; q < nr; ++q) {
                    const float m = job->mask[(size_t)idx[q] * ranks + j + p];
                    job->u[(size_t)idx[q] * ranks + j + p] = m == 0.0f ? 0.0f : dots[p][q] * m;
                }
        }
    }
}

/* out += u @ bt for the job's rows, a block of LORA_BLOCK outputs of one module at a time:
 * this thread's share of the blocks (thread_share). */
static void lora_outputs(const lora_job *job) {
    const int *order = job->order, *starts = job->starts;
    const int n = job->n, ranks = job->ranks;
    const size_t elem = held_bytes(job->held);
    int from, to;
    thread_share(job->blocks, &from, &to);
    for (int blk = from; blk < to; ++blk) {
        int module, i0, count;
        output_block(job, blk, &module, &i0, &count);
        for (int t = 0; t < job->groups; ++t) {
            const int *idx = order + starts[t], nr = starts[t + 1] - starts[t];
            int lo, hi;
            group_module_ranks(job, t, module, &lo, &hi);
            const float *ur[LORA_GROUP];
            float *dst[LORA_GROUP];
            for (int q = 0; q < nr; ++q) {
                ur[q] = job->u + (size_t)idx[q] * ranks + lo;
                dst[q] = job->out + (size_t)idx[q] * n + i0;
            }
            ranks_group(ur, nr, (const char *)job->bt + ((size_t)lo * n + i0) * elem, (size_t)n,
                        hi - lo, count, dst, job->held);
        }
    }
}

/* Whether a job's products take both threads' time (else they run on the calling thread). */
static int lora_parallel(const lora_job *job) { return job->work >= LORA_PARALLEL; }

/* The job's two products on the region's threads: the rank products, a barrier (past which
 * every thread's work before it is done too: the base products the delta adds to), the
 * output products. */
static void lora_products(const lora_job *job) {
    lora_ranks(job);
#pragma omp barrier
    lora_outputs(job);
}

/* The job's products in a region of their own. */
static inline void lora_run(const lora_job *job) {
#pragma omp parallel if (lora_parallel(job))
    lora_products(job);
}

/* Per layer and fused projection (qkv, o, gate_up, down, in that order), the columns of
 * kvf_decoder_stack's LoRA table (int64 each): a [R, k] and bt [R, n] pointers (the layer's
 * slice of the step's stacked adapter weights), mask [rows, R] float32, R, the parts bt is
 * block-diagonal in, and how a and bt are held (HELD_F32, HELD_BF16, HELD_F16); R = 0 is no
 * delta for that projection in that layer. */
enum { L_A, L_B, L_MASK, L_RANKS, L_PARTS, L_HELD, L_COLUMNS };
enum { G_QKV, G_O, G_GATE_UP, G_DOWN, G_COUNT };
#define LORA_MAX_RANKS 65536

int kvf_stack_lora_columns(void) { return G_COUNT * L_COLUMNS; }

/* The LoRA table's entry of projection g in layer l when it has a delta, else NULL. */
static inline const int64_t *lora_entry(const int64_t *lora, int l, int g) {
    if (lora == NULL) return NULL;
    const int64_t *e = lora + ((size_t)l * G_COUNT + g) * L_COLUMNS;
    return e[L_RANKS] > 0 ? e : NULL;
}

/* The job of table entry e's delta (k inputs, n outputs) planned in job, or NULL when e is
 * NULL (no delta); in its input, or NULL for the base product's own (spare [rows, k]: where
 * the base product makes none); ends: its modules' row ends when e has parts > 1 (checked
 * against them on entry to kvf_decoder_stack). */
static inline lora_job *lora_for(lora_job *job, const int64_t *e, const float *in, float *spare,
                                 int rows, int k, int n, const int *ends, float *out, float *u,
                                 int *span) {
    if (e == NULL) return NULL;
    lora_plan(job, in, spare, rows, k, (const void *)(intptr_t)e[L_A],
              (const void *)(intptr_t)e[L_B], (int)e[L_HELD], (const float *)(intptr_t)e[L_MASK],
              (int)e[L_RANKS], n, (int)e[L_PARTS], ends, out, u, span);
    return job;
}

/* from this many rows a job's own input (lora_input) is made on every thread
 * NOTE: measured on the 2-core AMX Xeon, SmolLM2-135M, 16 rows on rank-1 adapters: the
 * deltas' own work aside, a step cost ~2.3 ms more than the base's, the other thread
 * waiting at a barrier while one made every row's gate (1536 SiLUs a row, 30 layers). */
#define LORA_ROWS_PARALLEL 4

/* A job without an input gets x's rows after the gate and norm (input_row) in its spare, for
 * a base product that made none of its own. */
static inline void lora_input(lora_job *job, const float *x, int gated, const float *gamma,
                              float eps) {
    if (job->in != NULL) return;
    const int rows = job->rows, k = job->k;
#pragma omp parallel for schedule(static) if (rows >= LORA_ROWS_PARALLEL)
    for (int r = 0; r < rows; ++r)
        input_row(x + (size_t)r * k * (gated ? 2 : 1), k, gated, gamma, eps,
                  job->spare + (size_t)r * k);
    job->in = job->spare;
}
