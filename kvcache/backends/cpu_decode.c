/* Paged decode attention for bf16 (or float32) KV on CPU: one query token per sequence, read straight
 * from the pool's pages (no gathered copy), float32 math, online softmax.
 *
 * Built by kvcache/backends/cpu_decode.py with the system C compiler and loaded through
 * ctypes (the GIL is released for the call). OpenMP resolves to the libgomp torch already
 * loaded, so the kernel shares the calling thread's worker pool.
 *
 * Layout (kvcache/pool.py): one layer is [num_pages, 2 (K|V), page_size, Hkv, D].
 * Sequence b attends over its first lens[b] keys, on pages
 * indices[indptr[b] .. indptr[b + 1]); nothing outside those pages is read. With a window
 * w > 0 it attends over the last w of them only (keys lens[b] - w .. lens[b] - 1). With a
 * logit softcap c > 0 each scaled score s becomes c * tanh(s / c) before the softmax (Gemma 2);
 * those calls run the plain C job, the SIMD jobs compute uncapped scores only.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_PAGE 128
/* query tokens and heads one float32 job carries (a run of a chunk's tokens x the group) */
#define MAX_RUN 8
#define MAX_JOB_HEADS 32

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}

/* 2^f for |f| <= 1/2 by a degree-6 polynomial, highest power first (relative error ~2e-7):
 * the SIMD exps below compute exp(x) as 2^n * 2^f with n = round(x log2 e). */
static const float EXP2_POLY[7] = {1.5353362e-4f, 1.3398874e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                   2.4022651e-1f, 6.9314718e-1f, 1.0f};

int kvf_limits(int *max_group, int *max_dim, int *max_page) {
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    *max_page = MAX_PAGE;
    return 0;
}

/* ---- Boundary checks: every entry point runs these before it reads or writes KV memory ----
 * The Python side never sends a plan that fails them (its pages come from the fenced step);
 * they are the second line of defence the torch path's index_select gives, at O(batch +
 * pages) integer work a call. Status codes (DecodeKernel maps each to a KernelRefused): */
enum {
    KVF_ROW_OUTSIDE = -1,  /* a KV row outside the layer */
    KVF_BAD_SPANS = -2,    /* indptr not starting at 0, decreasing, or past the page list */
    KVF_BAD_PAGE = -3,     /* a page index outside [0, num_pages) */
    KVF_BAD_LENGTH = -4,   /* a length below 0 or past its sequence's pages */
    KVF_ROW_NOT_OWN = -5,  /* a KV row not on a page of its own sequence */
    KVF_BAD_SHAPE = -6,    /* batch, heads, dim or page size outside what the kernel takes */
    KVF_BAD_SOFTCAP = -7,  /* a logit softcap below 0 or not finite */
};

/* 0 for a softcap of 0 (none) or a finite positive one. */
static int check_softcap(float softcap) {
    return isfinite(softcap) && softcap >= 0.0f ? 0 : KVF_BAD_SOFTCAP;
}

/* The step plan: sequence b attends over its first lens[b] keys on pages
 * indices[indptr[b] .. indptr[b + 1]), of n_indices page indices in all, in a layer of
 * num_pages pages. 0, or the first failure's status. */
static int check_plan(const int32_t *indptr, const int32_t *indices, const int32_t *lens,
                      int batch, int64_t n_indices, int64_t num_pages, int page_size) {
    if (batch < 0 || page_size < 1 || n_indices < 0 || num_pages < 0) return KVF_BAD_SHAPE;
    if (indptr[0] != 0) return KVF_BAD_SPANS;
    for (int b = 0; b < batch; ++b) {
        const int64_t pages = (int64_t)indptr[b + 1] - indptr[b];
        if (pages < 0) return KVF_BAD_SPANS;
        if (lens[b] < 0 || (int64_t)lens[b] > pages * page_size) return KVF_BAD_LENGTH;
    }
    if ((int64_t)indptr[batch] > n_indices) return KVF_BAD_SPANS;
    for (int64_t p = 0; p < indptr[batch]; ++p)
        if (indices[p] < 0 || (int64_t)indices[p] >= num_pages) return KVF_BAD_PAGE;
    return 0;
}

static int check_shape(int batch, int hq, int hkv, int dim, int page_size) {
    if (batch < 0 || hkv < 1 || hq < hkv || hq % hkv != 0 || hq / hkv > MAX_GROUP || dim < 1 ||
        dim > MAX_DIM || page_size < 1 || page_size > MAX_PAGE)
        return KVF_BAD_SHAPE;
    return 0;
}

/* 0 when sequence b's K row rows[b] and V row rows[batch + b] are the K and V halves of one
 * slot on a page the plan gave sequence b (the plan checked first), else KVF_ROW_NOT_OWN.
 * The slot of the sequence's last key is looked at first (where a decode token writes). */
static int check_rows_owned(const int64_t *rows, const int32_t *indptr, const int32_t *indices,
                            const int32_t *lens, int batch, int page_size) {
    const int64_t span = 2 * (int64_t)page_size;
    for (int b = 0; b < batch; ++b) {
        const int64_t k = rows[b], page = k / span;
        if (k < 0 || k % span >= page_size || rows[batch + b] != k + page_size)
            return KVF_ROW_NOT_OWN;
        const int64_t first = indptr[b], last = indptr[b + 1];
        const int64_t at = lens[b] > 0 ? first + (lens[b] - 1) / page_size : last;
        int own = at < last && indices[at] == page;
        for (int64_t p = last - 1; !own && p >= first; --p) own = indices[p] == page;
        if (!own) return KVF_ROW_NOT_OWN;
    }
    return 0;
}

/* ---- end of the boundary checks ---- */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_AVX512 1

/* exp of 16 floats: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by a degree-6
 * polynomial (relative error ~2e-7); inputs below -87 give 0, a NaN stays NaN (max answers
 * its second operand when either is NaN, so x goes second). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
    return _mm512_scalef_ps(p, n);
}

/* One block of a head's online softmax: sv its 16 scaled scores (keys past live at -1e30),
 * *m and *l the running maximum and sum. Leaves the block's weights in w and answers what
 * the head's earlier accumulators are scaled by (0 on the first block). Every AVX-512 job
 * runs a block through this one function, so a query's softmax is the same arithmetic in
 * any of them. */
static inline __attribute__((always_inline)) float softmax_block(__m512 sv, __mmask16 live,
                                                                 float *m, float *l, float *w) {
    const float block_top = _mm512_reduce_max_ps(sv);
    const float top = block_top > *m ? block_top : *m;
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(top))));
    const float rescale = expf(*m - top);
    *l = *l * rescale + _mm512_reduce_add_ps(e);
    *m = top;
    _mm512_storeu_ps(w, e);
    return rescale;
}

/* One (sequence, KV head) job with AVX512-BF16: scores by bf16 dot products (exact
 * products, float32 sums, as a bf16 matmul computes them), then softmax and the weighted
 * sum of V in float32, 16 keys at a time. dim is a multiple of 32. */
static void job_avx512(const uint16_t *q, const uint16_t *kv, int first, int last,
                       const int32_t *indices, int n, int off, uint16_t *out, int group, int dim,
                       int64_t row, int64_t half, int page_size, float scale) {
    const int chunks = dim / 32; /* 32 bf16 per dot-product instruction */
    const int lanes = dim / 16;  /* 16 float32 per accumulator */
    __m512bh qv[MAX_GROUP][MAX_DIM / 32];
    __m512 acc[MAX_GROUP][MAX_DIM / 16];
    float s[MAX_GROUP][16];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        for (int c = 0; c < chunks; ++c)
            qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(q + g * dim + 32 * c));
        for (int c = 0; c < lanes; ++c) acc[g][c] = _mm512_setzero_ps();
        m[g] = -1e30f;
        l[g] = 0.0f;
    }
    for (int p = first, start = 0; p < last && start < n; ++p, start += page_size) {
        const int count = n - start < page_size ? n - start : page_size;
        const int from = p == first ? off : 0; /* keys before a window are not read */
        const uint16_t *k_page = kv + (int64_t)indices[p] * 2 * half;
        const uint16_t *v_page = k_page + half;
        for (int b0 = from; b0 < count; b0 += 16) {
            const int nb = count - b0 < 16 ? count - b0 : 16;
            const __mmask16 live = (__mmask16)((1u << nb) - 1u);
            for (int o = 0; o < nb; ++o) {
                const uint16_t *k_row = k_page + (b0 + o) * row;
                __m512bh kr[MAX_DIM / 32];
                for (int c = 0; c < chunks; ++c)
                    kr[c] = (__m512bh)_mm512_loadu_si512((const void *)(k_row + 32 * c));
                for (int g = 0; g < group; ++g) {
                    __m512 dot = _mm512_setzero_ps();
                    for (int c = 0; c < chunks; ++c) dot = _mm512_dpbf16_ps(dot, qv[g][c], kr[c]);
                    s[g][o] = _mm512_reduce_add_ps(dot);
                }
            }
            for (int g = 0; g < group; ++g) {
                const __m512 sv = _mm512_mul_ps(
                    _mm512_mask_loadu_ps(_mm512_set1_ps(-1e30f), live, s[g]),
                    _mm512_set1_ps(scale));
                const float rescale = softmax_block(sv, live, &m[g], &l[g], s[g]);
                const __m512 r = _mm512_set1_ps(rescale);
                for (int c = 0; c < lanes; ++c) {
                    __m512 a = _mm512_mul_ps(acc[g][c], r);
                    for (int o = 0; o < nb; ++o) {
                        const __m256i raw = _mm256_loadu_si256(
                            (const __m256i *)(v_page + (b0 + o) * row + 16 * c));
                        a = _mm512_fmadd_ps(_mm512_set1_ps(s[g][o]),
                                            _mm512_cvtpbh_ps((__m256bh)raw), a);
                    }
                    acc[g][c] = a;
                }
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        float tmp[16];
        for (int c = 0; c < lanes; ++c) {
            _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv)));
            for (int d = 0; d < 16; ++d) out[g * dim + 16 * c + d] = f32_to_bf16(tmp[d]);
        }
    }
}

/* lane o of the result = the sum of v[o]'s 16 lanes: pairs, then quads within each 128-bit
 * lane, then across the four 128-bit lanes (45 shuffles and adds for 16 sums, against ~8
 * each one at a time). */
static inline __m512 sums16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                    _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                    _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* 16 keys' or values' floats at element ``at`` of a pool stored in float32, or (kv16) in
 * bf16, widened exactly. */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *kv, int64_t at,
                                                              int kv16) {
    if (kv16)
        return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)((const uint16_t *)kv + at)));
    return _mm512_loadu_ps((const float *)kv + at);
}

/* One (sequence, KV head) job for float32 q and out with AVX-512, over float32 KV or (kv16)
 * bf16 KV widened as it is read, 16 keys at a time: each K row read and widened once for
 * the whole group, each head's 16 dot products summed together (sums16), and each V row
 * read once for the whole group. dim is a multiple of 16.
 * NOTE: measured on a 2-core AMX Xeon, offline (64 requests, float32 compute): job_avx2_f32
 * took ~21% of the run's CPU samples, the bf16 kernel (job_avx512) ~17% of a bf16 run's. */
static inline __attribute__((always_inline)) void job_avx512_f32q(
    const float *q, const void *kv, int first, int last, const int32_t *indices, int n,
    int off, float *out, int group, int dim, int64_t row, int64_t half, int page_size, float scale,
    const int kv16) {
    const int lanes = dim / 16;
    __m512 qv[MAX_GROUP][MAX_DIM / 16];
    __m512 acc[MAX_GROUP][MAX_DIM / 16];
    __m512 dots[MAX_GROUP][16]; /* a block's 16 keys' partial dot products, per head */
    float s[MAX_GROUP][16];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        for (int c = 0; c < lanes; ++c) {
            qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * dim + 16 * c), _mm512_set1_ps(scale));
            acc[g][c] = _mm512_setzero_ps();
        }
        m[g] = -1e30f;
        l[g] = 0.0f;
    }
    for (int p = first, start = 0; p < last && start < n; ++p, start += page_size) {
        const int count = n - start < page_size ? n - start : page_size;
        const int from = p == first ? off : 0; /* keys before a window are not read */
        const int64_t k_page = (int64_t)indices[p] * 2 * half; /* element offsets */
        const int64_t v_page = k_page + half;
        for (int b0 = from; b0 < count; b0 += 16) {
            const int nb = count - b0 < 16 ? count - b0 : 16;
            const __mmask16 live = (__mmask16)((1u << nb) - 1u);
            /* each key row is read and widened once for the whole group */
            for (int o = 0; o < 16; ++o) {
                if (o >= nb) {
                    for (int g = 0; g < group; ++g) dots[g][o] = _mm512_setzero_ps();
                    continue;
                }
                const int64_t k_row = k_page + (b0 + o) * row;
                __m512 kr[MAX_DIM / 16];
                for (int c = 0; c < lanes; ++c) kr[c] = kv_load16(kv, k_row + 16 * c, kv16);
                for (int g = 0; g < group; ++g) {
                    __m512 d = _mm512_setzero_ps();
                    for (int c = 0; c < lanes; ++c) d = _mm512_fmadd_ps(qv[g][c], kr[c], d);
                    dots[g][o] = d;
                }
            }
            for (int g = 0; g < group; ++g) {
                const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), live, sums16(dots[g]));
                const float rescale = softmax_block(sv, live, &m[g], &l[g], s[g]);
                for (int c = 0; c < lanes; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(rescale));
            }
            for (int o = 0; o < nb; ++o) {
                const int64_t v_row = v_page + (b0 + o) * row;
                for (int c = 0; c < lanes; ++c) {
                    const __m512 v = kv_load16(kv, v_row + 16 * c, kv16);
                    for (int g = 0; g < group; ++g)
                        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[g][o]), v, acc[g][c]);
                }
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
        for (int c = 0; c < lanes; ++c)
            _mm512_storeu_ps(out + g * dim + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
}

static void job_avx512_f32(const float *q, const void *kv, int first, int last,
                           const int32_t *indices, int n, int off, float *out, int group, int dim,
                           int64_t row, int64_t half, int page_size, float scale) {
    job_avx512_f32q(q, kv, first, last, indices, n, off, out, group, dim, row, half, page_size, scale, 0);
}

static void job_avx512_bf16kv(const float *q, const void *kv, int first, int last,
                              const int32_t *indices, int n, int off, float *out, int group, int dim,
                              int64_t row, int64_t half, int page_size, float scale) {
    job_avx512_f32q(q, kv, first, last, indices, n, off, out, group, dim, row, half, page_size, scale, 1);
}

/* One job for float32 q and out with AVX-512, over float32 KV or (kv16) bf16 KV widened as
 * it is read, 16 keys at a time: queries 0 .. runs - 1 of one KV head that attend over the
 * same pages (a prefill chunk's consecutive tokens), query t
 * over its first ns[t] keys, its group of heads at q + t * q_stride (out alike). A block's K
 * and V rows are read and widened once for the whole job; each head's 16 dot products are
 * summed together (sums16). A query's arithmetic is that of a job of its own: the same
 * products and sums in the same order, its block's keys past ns[t] masked out, blocks past
 * its keys never touched, so a token's result does not depend on the run it is in.
 * dim = 16 * lanes (a constant where inlined for one head size: q and the accumulators
 * then live in registers); runs * group <= MAX_JOB_HEADS; called for runs of two or more
 * and only without a window (first: the sequence's first page).
 * NOTE: measured on a 2-core AMX Xeon, SmolLM2-135M's shapes (3 KV heads of 3 query heads,
 * dim 64, bf16 KV), one layer of a 512-token prefill step, every token a job of its own
 * (job_avx512_f32q) against runs of MAX_RUN: 4 chunks of 128 tokens 1.3-1.7 against
 * 0.85-0.94 ms, 2 of 256 3.8-4.3 against 1.7 ms (with each head's softmax step right after
 * its scores, rather than the group's side by side: 1.1 and 2.0 ms). A decode
 * row (a run of one) stays on job_avx512_f32q: this job's staging of the block cost it
 * 30% there (64 rows of 300 keys: 1.5 against 1.15 ms). */
static inline __attribute__((always_inline)) void run_avx512_f32q(
    const float *q, int64_t q_stride, const void *kv, int first, int last,
    const int32_t *indices, const int *ns, int runs, float *out, int group,
    const int lanes, int64_t row, int64_t half, int page_size, float scale, const int kv16) {
    const int dim = 16 * lanes;
    __m512 acc[MAX_JOB_HEADS][MAX_DIM / 16];
    __m512 kw[16][MAX_DIM / 16], vw[16][MAX_DIM / 16]; /* a block's keys and values, widened */
    __m512 dots[16]; /* one head's partial dot products with the block's keys */
    float m[MAX_JOB_HEADS], l[MAX_JOB_HEADS];
    int n_max = 0;
    for (int t = 0; t < runs; ++t) n_max = ns[t] > n_max ? ns[t] : n_max;
    for (int j = 0; j < runs * group; ++j) {
        for (int c = 0; c < lanes; ++c) acc[j][c] = _mm512_setzero_ps();
        m[j] = -1e30f;
        l[j] = 0.0f;
    }
    for (int p = first, start = 0; p < last && start < n_max; ++p, start += page_size) {
        const int count = n_max - start < page_size ? n_max - start : page_size;
        const int64_t k_page = (int64_t)indices[p] * 2 * half; /* element offsets */
        const int64_t v_page = k_page + half;
        for (int b0 = 0; b0 < count; b0 += 16) {
            const int nb = count - b0 < 16 ? count - b0 : 16;
            for (int o = 0; o < nb; ++o)
                for (int c = 0; c < lanes; ++c) {
                    kw[o][c] = kv_load16(kv, k_page + (b0 + o) * row + 16 * c, kv16);
                    vw[o][c] = kv_load16(kv, v_page + (b0 + o) * row + 16 * c, kv16);
                }
            for (int t = 0; t < runs; ++t) {
                /* the keys query t reads in this block: as its own job's block would hold */
                const int own = ns[t] - start < page_size ? ns[t] - start : page_size;
                const int nt = own - b0 <= 0 ? 0 : own - b0 < 16 ? own - b0 : 16;
                if (nt == 0) continue;
                const __mmask16 live = (__mmask16)((1u << nt) - 1u);
                /* the group's scores, then their softmax steps side by side (independent
                 * chains of horizontal reductions and exps, which overlap), then values */
                __m512 sv[MAX_GROUP];
                for (int g = 0; g < group; ++g) {
                    const float *qh = q + t * q_stride + g * dim;
                    __m512 qr[MAX_DIM / 16];
                    for (int c = 0; c < lanes; ++c)
                        qr[c] = _mm512_mul_ps(_mm512_loadu_ps(qh + 16 * c), _mm512_set1_ps(scale));
                    for (int o = 0; o < 16; ++o) {
                        __m512 d = _mm512_setzero_ps();
                        if (o < nt)
                            for (int c = 0; c < lanes; ++c) d = _mm512_fmadd_ps(qr[c], kw[o][c], d);
                        dots[o] = d;
                    }
                    sv[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), live, sums16(dots));
                }
                float w[MAX_GROUP][16], rescale[MAX_GROUP];
                for (int g = 0; g < group; ++g)
                    rescale[g] = softmax_block(sv[g], live, &m[t * group + g], &l[t * group + g], w[g]);
                for (int g = 0; g < group; ++g) {
                    const int j = t * group + g;
                    __m512 a[MAX_DIM / 16];
                    for (int c = 0; c < lanes; ++c) a[c] = _mm512_mul_ps(acc[j][c], _mm512_set1_ps(rescale[g]));
                    for (int o = 0; o < nt; ++o) {
                        const __m512 wo = _mm512_set1_ps(w[g][o]);
                        for (int c = 0; c < lanes; ++c) a[c] = _mm512_fmadd_ps(wo, vw[o][c], a[c]);
                    }
                    for (int c = 0; c < lanes; ++c) acc[j][c] = a[c];
                }
            }
        }
    }
    for (int t = 0; t < runs; ++t)
        for (int g = 0; g < group; ++g) {
            const int j = t * group + g;
            const __m512 inv = _mm512_set1_ps(l[j] > 0.0f ? 1.0f / l[j] : 0.0f);
            for (int c = 0; c < lanes; ++c)
                _mm512_storeu_ps(out + t * q_stride + g * dim + 16 * c, _mm512_mul_ps(acc[j][c], inv));
        }
}

/* run_avx512_f32q for a head size: constant lanes for the common ones (64 and 128) */
#define KVF_F32Q_RUN(name, kv16)                                                              \
    static void name(const float *q, int64_t q_stride, const void *kv, int first, int last,   \
                     const int32_t *indices, const int *ns, int runs, float *out,             \
                     int group, int dim, int64_t row, int64_t half, int page_size,           \
                     float scale) {                                                           \
        if (dim == 64)                                                                        \
            run_avx512_f32q(q, q_stride, kv, first, last, indices, ns, runs, out, group, \
                            4, row, half, page_size, scale, kv16);                           \
        else if (dim == 128)                                                                  \
            run_avx512_f32q(q, q_stride, kv, first, last, indices, ns, runs, out, group, \
                            8, row, half, page_size, scale, kv16);                           \
        else                                                                                  \
            run_avx512_f32q(q, q_stride, kv, first, last, indices, ns, runs, out, group, \
                            dim / 16, row, half, page_size, scale, kv16);                    \
    }
KVF_F32Q_RUN(run_avx512_f32, 0)
KVF_F32Q_RUN(run_avx512_bf16kv, 1)
#endif

#if defined(__AVX2__) && defined(__FMA__)
#ifndef KVF_AVX512
#include <immintrin.h>
#endif
#define KVF_AVX2 1

/* exp of 8 floats as exp16 computes 16 (inputs clamped below at -87, a NaN kept), 2^n built
 * in the exponent bits. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum8f(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8f(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One (sequence, KV head) job for float32 KV with AVX2: the structure of job_avx512, 8 keys
 * at a time. dim is a multiple of 8.
 * NOTE: measured on a 2-core AVX2 EPYC (3 KV heads of 64, a group of 3): a layer's call at
 * 128 keys took 18.8 us in the plain C loops (job_portable). */
static void job_avx2_f32(const float *q, const float *kv, int first, int last,
                         const int32_t *indices, int n, int off, float *out, int group, int dim,
                         int64_t row, int64_t half, int page_size, float scale) {
    const int lanes = dim / 8;
    __m256 qv[MAX_GROUP][MAX_DIM / 8];
    __m256 acc[MAX_GROUP][MAX_DIM / 8];
    float s[MAX_GROUP][8];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        for (int c = 0; c < lanes; ++c) {
            qv[g][c] = _mm256_mul_ps(_mm256_loadu_ps(q + g * dim + 8 * c), _mm256_set1_ps(scale));
            acc[g][c] = _mm256_setzero_ps();
        }
        m[g] = -1e30f;
        l[g] = 0.0f;
    }
    for (int p = first, start = 0; p < last && start < n; ++p, start += page_size) {
        const int count = n - start < page_size ? n - start : page_size;
        const int from = p == first ? off : 0; /* keys before a window are not read */
        const float *k_page = kv + (int64_t)indices[p] * 2 * half;
        const float *v_page = k_page + half;
        for (int b0 = from; b0 < count; b0 += 8) {
            const int nb = count - b0 < 8 ? count - b0 : 8;
            for (int o = 0; o < nb; ++o) {
                const float *k_row = k_page + (b0 + o) * row;
                for (int g = 0; g < group; ++g) {
                    __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
                    int c = 0;
                    for (; c + 1 < lanes; c += 2) {
                        d0 = _mm256_fmadd_ps(qv[g][c], _mm256_loadu_ps(k_row + 8 * c), d0);
                        d1 = _mm256_fmadd_ps(qv[g][c + 1], _mm256_loadu_ps(k_row + 8 * c + 8), d1);
                    }
                    if (c < lanes) d0 = _mm256_fmadd_ps(qv[g][c], _mm256_loadu_ps(k_row + 8 * c), d0);
                    s[g][o] = hsum8f(_mm256_add_ps(d0, d1));
                }
            }
            for (int o = nb; o < 8; ++o)
                for (int g = 0; g < group; ++g) s[g][o] = -1e30f;
            const __m256 live = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(nb), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
            for (int g = 0; g < group; ++g) {
                const __m256 sv = _mm256_loadu_ps(s[g]);
                const float block_top = hmax8f(sv);
                const float top = block_top > m[g] ? block_top : m[g];
                const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(sv, _mm256_set1_ps(top))), live);
                const float rescale = expf(m[g] - top); /* 0 on the first block */
                l[g] = l[g] * rescale + hsum8f(e);
                m[g] = top;
                _mm256_storeu_ps(s[g], e);
                const __m256 r = _mm256_set1_ps(rescale);
                for (int c = 0; c < lanes; ++c) {
                    __m256 a = _mm256_mul_ps(acc[g][c], r);
                    for (int o = 0; o < nb; ++o)
                        a = _mm256_fmadd_ps(_mm256_set1_ps(s[g][o]),
                                            _mm256_loadu_ps(v_page + (b0 + o) * row + 8 * c), a);
                    acc[g][c] = a;
                }
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        const __m256 inv = _mm256_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
        for (int c = 0; c < lanes; ++c)
            _mm256_storeu_ps(out + g * dim + 8 * c, _mm256_mul_ps(acc[g][c], inv));
    }
}
#endif

/* One (sequence, KV head) job in plain C loops (vectorized by the compiler), for bf16 or
 * float32 (q32) q and out, over bf16 or float32 (kv32) KV. */
static void job_portable(const void *q_, const void *kv_, int first, int last,
                         const int32_t *indices, int n, int off, void *out_, int group, int dim,
                         int64_t row, int64_t half, int page_size, float scale, int q32,
                         int kv32, float softcap) {
    float qf[MAX_GROUP][MAX_DIM];
    float acc[MAX_GROUP][MAX_DIM];
    float s[MAX_GROUP][MAX_PAGE];
    float kf[MAX_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int g = 0; g < group; ++g) {
        if (q32) {
            const float *src = (const float *)q_ + (int64_t)g * dim;
            for (int d = 0; d < dim; ++d) qf[g][d] = src[d] * scale;
        } else {
            const uint16_t *src = (const uint16_t *)q_ + (int64_t)g * dim;
            for (int d = 0; d < dim; ++d) qf[g][d] = bf16_to_f32(src[d]) * scale;
        }
        memset(acc[g], 0, sizeof(float) * (size_t)dim);
        m[g] = -1e30f;
        l[g] = 0.0f;
    }
    for (int p = first, start = 0; p < last && start < n; ++p, start += page_size) {
        const int count = n - start < page_size ? n - start : page_size;
        const int from = p == first ? off : 0; /* keys before a window are not read */
        const int64_t k_page = (int64_t)indices[p] * 2 * half; /* element offsets */
        const int64_t v_page = k_page + half;
        for (int o = from; o < count; ++o) {
            const int64_t k_row = k_page + o * row;
            if (kv32) {
                memcpy(kf, (const float *)kv_ + k_row, sizeof(float) * (size_t)dim);
            } else {
                const uint16_t *src = (const uint16_t *)kv_ + k_row;
#pragma omp simd
                for (int d = 0; d < dim; ++d) kf[d] = bf16_to_f32(src[d]);
            }
            for (int g = 0; g < group; ++g) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < dim; ++d) dot += qf[g][d] * kf[d];
                /* Gemma 2's cap on the scaled score, as transformers computes it */
                s[g][o] = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;
            }
        }
        for (int g = 0; g < group; ++g) {
            float top = m[g];
#pragma omp simd reduction(max : top)
            for (int o = from; o < count; ++o) top = s[g][o] > top ? s[g][o] : top;
            const float rescale = expf(m[g] - top); /* 0 on the first page */
            float sum = l[g] * rescale;
#pragma omp simd reduction(+ : sum)
            for (int o = from; o < count; ++o) {
                s[g][o] = expf(s[g][o] - top);
                sum += s[g][o];
            }
            if (rescale != 1.0f) {
#pragma omp simd
                for (int d = 0; d < dim; ++d) acc[g][d] *= rescale;
            }
            m[g] = top;
            l[g] = sum;
        }
        for (int o = from; o < count; ++o) {
            const int64_t v_row = v_page + o * row;
            if (kv32) {
                memcpy(kf, (const float *)kv_ + v_row, sizeof(float) * (size_t)dim);
            } else {
                const uint16_t *src = (const uint16_t *)kv_ + v_row;
#pragma omp simd
                for (int d = 0; d < dim; ++d) kf[d] = bf16_to_f32(src[d]);
            }
            for (int g = 0; g < group; ++g) {
                const float w = s[g][o];
#pragma omp simd
                for (int d = 0; d < dim; ++d) acc[g][d] += w * kf[d];
            }
        }
    }
    for (int g = 0; g < group; ++g) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        if (q32) {
            float *dst = (float *)out_ + (int64_t)g * dim;
            for (int d = 0; d < dim; ++d) dst[d] = acc[g][d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)out_ + (int64_t)g * dim;
            for (int d = 0; d < dim; ++d) dst[d] = f32_to_bf16(acc[g][d] * inv);
        }
    }
}

/* The runs a step's jobs carry: sequences starts[r] .. starts[r + 1] - 1 (at most max_run)
 * attend over the same page list (a prefill chunk's tokens, each a row of its own). Returns
 * the number of runs; starts has batch + 1 entries. */
static int plan_runs(const int32_t *indptr, const int32_t *indices, int batch, int max_run,
                     int *starts) {
    int runs = 0;
    for (int b = 0; b < batch;) {
        const int32_t first = indptr[b], pages = indptr[b + 1] - first;
        int e = b + 1;
        while (e < batch && e - b < max_run && indptr[e + 1] - indptr[e] == pages &&
               memcmp(indices + indptr[e], indices + first, (size_t)pages * sizeof(int32_t)) == 0)
            ++e;
        starts[runs++] = b;
        b = e;
    }
    starts[runs] = batch;
    return runs;
}

/* Every (run of sequences, KV head) job of a step: q and out bf16 or float32 (q32), KV bf16
 * or float32 (kv32); softcap > 0 caps the scores (the plain C job). A run is one sequence,
 * or (float32 q on AVX-512, no window) up to MAX_RUN sequences on the same pages. */
static void decode_jobs(const void *q, const void *kv, const int32_t *indptr,
                        const int32_t *indices, const int32_t *lens, void *out, int batch,
                        int hq, int hkv, int dim, int page_size, float scale, int q32,
                        int kv32, int window, float softcap) {
    /* NOTE: only softcapped models (Gemma 2) pay for the plain loops and tanhf. */
    const int simd = softcap == 0.0f;
    (void)simd; /* read only where a SIMD job is compiled in */
    const int group = hq / hkv;
    const int64_t row = (int64_t)hkv * dim;          /* one slot: all heads */
    const int64_t half = (int64_t)page_size * row;   /* K or V of one page */
    const size_t elem = q32 ? sizeof(float) : sizeof(uint16_t);
    const size_t kv_elem = kv32 ? sizeof(float) : sizeof(uint16_t);
    int max_run = 1;
#ifdef KVF_AVX512
    if (simd && q32 && dim % 16 == 0 && window == 0)
        max_run = MAX_JOB_HEADS / group < MAX_RUN ? MAX_JOB_HEADS / group : MAX_RUN;
#endif
    /* without the scratch (or with runs of one) every sequence is a run of its own */
    int *starts = max_run > 1 ? malloc(((size_t)batch + 1) * sizeof(int)) : NULL;
    const int runs = starts != NULL ? plan_runs(indptr, indices, batch, max_run, starts) : batch;
#pragma omp parallel for schedule(dynamic, 1)
    for (int job = 0; job < runs * hkv; ++job) {
        const int r = job / hkv, h = job % hkv;
        const int b = starts != NULL ? starts[r] : r;
        const int count = starts != NULL ? starts[r + 1] - b : 1;
        (void)count; /* read only where the AVX-512 float32 job is compiled in */
        const int n = lens[b];
        /* A window reads the last `window` keys only: whole pages before them are skipped,
         * and `off` keys of the first page read (runs of more than one have no window). */
        const int lo = window > 0 && n > window ? n - window : 0;
        const int first = indptr[b] + lo / page_size, kept = n - (lo / page_size) * page_size;
        const int off = lo % page_size;
        const size_t at = (size_t)(((int64_t)b * hq + h * group) * dim) * elem;
        const char *qb = (const char *)q + at, *kvb = (const char *)kv + (size_t)(h * dim) * kv_elem;
        char *ob = (char *)out + at;
#ifdef KVF_AVX512
        if (simd && !q32 && !kv32 && dim % 32 == 0) {
            job_avx512((const uint16_t *)qb, (const uint16_t *)kvb, first, indptr[b + 1],
                       indices, kept, off, (uint16_t *)ob, group, dim, row, half, page_size, scale);
            continue;
        }
#endif
#ifdef KVF_AVX512
        if (simd && q32 && dim % 16 == 0 && count > 1) {
            int ns[MAX_RUN];
            for (int t = 0; t < count; ++t) ns[t] = lens[b + t];
            (kv32 ? run_avx512_f32 : run_avx512_bf16kv)(
                (const float *)qb, (int64_t)hq * dim, kvb, indptr[b], indptr[b + 1], indices,
                ns, count, (float *)ob, group, dim, row, half, page_size, scale);
            continue;
        }
        if (simd && q32 && dim % 16 == 0) {
            (kv32 ? job_avx512_f32 : job_avx512_bf16kv)((const float *)qb, kvb, first,
                                                        indptr[b + 1], indices, kept, off,
                                                        (float *)ob, group, dim, row, half,
                                                        page_size, scale);
            continue;
        }
#endif
#ifdef KVF_AVX2
        if (simd && q32 && kv32 && dim % 8 == 0) {
            job_avx2_f32((const float *)qb, (const float *)kvb, first, indptr[b + 1],
                         indices, kept, off, (float *)ob, group, dim, row, half, page_size, scale);
            continue;
        }
#endif
        job_portable(qb, kvb, first, indptr[b + 1], indices, kept, off, ob, group, dim, row, half,
                     page_size, scale, q32, kv32, softcap);
    }
    free(starts);
}

/* The plan and shape checks, then decode_jobs: 0, or a KVF_ status with nothing read. */
static int checked_decode(const void *q, const void *kv, const int32_t *indptr,
                          const int32_t *indices, const int32_t *lens, void *out, int batch,
                          int hq, int hkv, int dim, int page_size, float scale, int q32, int kv32,
                          int64_t n_indices, int64_t num_pages, int window, float softcap) {
    int status = check_shape(batch, hq, hkv, dim, page_size);
    if (status == 0) status = check_softcap(softcap);
    if (status == 0)
        status = check_plan(indptr, indices, lens, batch, n_indices, num_pages, page_size);
    if (status == 0)
        decode_jobs(q, kv, indptr, indices, lens, out, batch, hq, hkv, dim, page_size, scale, q32,
                    kv32, window, softcap);
    return status;
}

/* q, out: [B, Hq, D] bf16 (contiguous). kv: one layer of the pool, num_pages pages; the plan
 * has n_indices page indices. 0, or a KVF_ status (nothing read). */
int kvf_decode_bf16(const uint16_t *q, const uint16_t *kv, const int32_t *indptr,
                    const int32_t *indices, const int32_t *lens, uint16_t *out, int batch,
                    int hq, int hkv, int dim, int page_size, float scale, int64_t n_indices,
                    int64_t num_pages, int window, float softcap) {
    return checked_decode(q, kv, indptr, indices, lens, out, batch, hq, hkv, dim, page_size,
                          scale, 0, 0, n_indices, num_pages, window, softcap);
}

/* The same for float32 q, kv and out (the float32 engine's decode rows). */
int kvf_decode_f32(const float *q, const float *kv, const int32_t *indptr,
                   const int32_t *indices, const int32_t *lens, float *out, int batch, int hq,
                   int hkv, int dim, int page_size, float scale, int64_t n_indices,
                   int64_t num_pages, int window, float softcap) {
    return checked_decode(q, kv, indptr, indices, lens, out, batch, hq, hkv, dim, page_size,
                          scale, 1, 1, n_indices, num_pages, window, softcap);
}

/* Float32 q and out over bf16 KV (--dtype auto on bf16 CPUs: float32 compute, KV stored in
 * the dense weights' bf16). */
int kvf_decode_f32_bf16kv(const float *q, const uint16_t *kv, const int32_t *indptr,
                          const int32_t *indices, const int32_t *lens, float *out, int batch,
                          int hq, int hkv, int dim, int page_size, float scale,
                          int64_t n_indices, int64_t num_pages, int window, float softcap) {
    return checked_decode(q, kv, indptr, indices, lens, out, batch, hq, hkv, dim, page_size,
                          scale, 1, 0, n_indices, num_pages, window, softcap);
}

/* 0 when every one of the 2 * batch rows is inside the layer, else -1. */
static int rows_inside(const int64_t *rows, int64_t layer_rows, int batch) {
    for (int i = 0; i < 2 * batch; ++i)
        if (rows[i] < 0 || rows[i] >= layer_rows) return -1;
    return 0;
}

/* Everything a fused write-and-attend call trusts: the shapes, the plan, every row inside
 * the layer (of layer_rows slots: pages x 2 x page_size) and on its own sequence's pages. */
static int check_write(const int64_t *rows, int64_t layer_rows, const int32_t *indptr,
                       const int32_t *indices, const int32_t *lens, int batch, int hq, int hkv,
                       int dim, int page_size, int64_t n_indices) {
    int status = check_shape(batch, hq, hkv, dim, page_size);
    if (status != 0) return status;
    status = check_plan(indptr, indices, lens, batch, n_indices,
                        layer_rows / (2 * (int64_t)page_size), page_size);
    if (status != 0) return status;
    if (rows_inside(rows, layer_rows, batch) != 0) return KVF_ROW_OUTSIDE;
    return check_rows_owned(rows, indptr, indices, lens, batch, page_size);
}

int kvf_check_step(const int64_t *rows, int64_t layer_rows, const int32_t *indptr,
                   const int32_t *indices, const int32_t *lens, int batch, int hq, int hkv,
                   int dim, int page_size, int64_t n_indices) {
    return check_write(rows, layer_rows, indptr, indices, lens, batch, hq, hkv, dim, page_size,
                       n_indices);
}

/* Store k, v [B, Hkv, D] (contiguous, elem bytes a value) at the flat slots rows[b] (K) and
 * rows[batch + b] (V) of one layer, whose slots run [page, K|V, offset]
 * (kvcache.metadata.kv_rows). The caller ran check_write. */
static void write_rows(const void *k, const void *v, void *kv, const int64_t *rows, int batch,
                       int hkv, int dim, size_t elem) {
    const size_t row = (size_t)hkv * dim * elem;
    for (int b = 0; b < batch; ++b) {
        memcpy((char *)kv + (size_t)rows[b] * row, (const char *)k + b * row, row);
        memcpy((char *)kv + (size_t)rows[batch + b] * row, (const char *)v + b * row, row);
    }
}

/* One call per layer for an all-decode step (the compiled step's, and the eager float32
 * step's): check_write, write_rows, then attend as kvf_decode_bf16 / kvf_decode_f32. 0, or
 * a KVF_ status with nothing written or read. */
int kvf_write_decode_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *kv,
                          const int64_t *rows, int64_t layer_rows, const int32_t *indptr,
                          const int32_t *indices, const int32_t *lens, uint16_t *out, int batch,
                          int hq, int hkv, int dim, int page_size, float scale,
                          int64_t n_indices, int window,
                         float softcap) {
    int status = check_write(rows, layer_rows, indptr, indices, lens, batch, hq, hkv, dim,
                                   page_size, n_indices);
    if (status == 0) status = check_softcap(softcap);
    if (status != 0) return status;
    write_rows(k, v, kv, rows, batch, hkv, dim, sizeof(uint16_t));
    decode_jobs(q, kv, indptr, indices, lens, out, batch, hq, hkv, dim, page_size, scale, 0, 0,
                window, softcap);
    return 0;
}

/* write_rows for float32 k, v into a bf16 layer, each value rounded to nearest even (as
 * torch's float32 -> bf16 conversion rounds it). */
static void write_rows_to_bf16(const float *k, const float *v, uint16_t *kv, const int64_t *rows,
                               int batch, int hkv, int dim) {
    const size_t row = (size_t)hkv * dim;
    for (int b = 0; b < batch; ++b) {
        uint16_t *kd = kv + (size_t)rows[b] * row, *vd = kv + (size_t)rows[batch + b] * row;
        for (size_t j = 0; j < row; ++j) {
            kd[j] = f32_to_bf16(k[b * row + j]);
            vd[j] = f32_to_bf16(v[b * row + j]);
        }
    }
}

int kvf_write_decode_f32_bf16kv(const float *q, const float *k, const float *v, uint16_t *kv,
                                const int64_t *rows, int64_t layer_rows, const int32_t *indptr,
                                const int32_t *indices, const int32_t *lens, float *out,
                                int batch, int hq, int hkv, int dim, int page_size, float scale,
                                int64_t n_indices, int window,
                         float softcap) {
    int status = check_write(rows, layer_rows, indptr, indices, lens, batch, hq, hkv, dim,
                                   page_size, n_indices);
    if (status == 0) status = check_softcap(softcap);
    if (status != 0) return status;
    write_rows_to_bf16(k, v, kv, rows, batch, hkv, dim);
    decode_jobs(q, kv, indptr, indices, lens, out, batch, hq, hkv, dim, page_size, scale, 1, 0,
                window, softcap);
    return 0;
}

int kvf_write_decode_f32(const float *q, const float *k, const float *v, float *kv,
                         const int64_t *rows, int64_t layer_rows, const int32_t *indptr,
                         const int32_t *indices, const int32_t *lens, float *out, int batch,
                         int hq, int hkv, int dim, int page_size, float scale, int64_t n_indices, int window,
                         float softcap) {
    int status = check_write(rows, layer_rows, indptr, indices, lens, batch, hq, hkv, dim,
                                   page_size, n_indices);
    if (status == 0) status = check_softcap(softcap);
    if (status != 0) return status;
    write_rows(k, v, kv, rows, batch, hkv, dim, sizeof(float));
    decode_jobs(q, kv, indptr, indices, lens, out, batch, hq, hkv, dim, page_size, scale, 1, 1,
                window, softcap);
    return 0;
}

/* An all-decode float32 step's attention for native model code: the model's own C code
 * (service/model/native/stack.h, kvf_decoder_stack) runs a whole decode forward and hands each
 * layer's q, k, v to kvf_step_attend_f32 with this context. Everything that addresses KV
 * memory (the pool, the rows to write, each sequence's pages and length) is here, built by
 * DecodeKernel.step_context from the step's checked metadata; the caller passes only the
 * layer index and its own q, k, v and output buffers. */
typedef struct {
    void *kv;               /* the pool [layers, pages, 2, page_size, Hkv, D], float32 or bf16 */
    int64_t layer_elems;    /* floats in one layer */
    int64_t layer_rows;     /* [Hkv, D] rows in one layer (pages x 2 x page_size) */
    const int64_t *rows;    /* [2, batch] this step's K rows, then V rows */
    const int32_t *indptr;  /* [batch + 1] */
    const int32_t *indices; /* the sequences' pages */
    const int32_t *lens;    /* [batch] keys each sequence attends over */
    int32_t layers, batch, hq, hkv, dim, page_size;
    float scale;
    int32_t kv16;           /* the pool holds bf16 (float32 q, k, v and out all the same) */
    int64_t n_indices;      /* page indices in the plan */
    const int32_t *windows; /* [layers] each layer's window (0: every key), or NULL: none */
    const float *softcaps;  /* [layers] each layer's logit softcap (0: none), or NULL: none */
} kvf_step_ctx;

/* q [batch, Hq, D], k and v [batch, Hkv, D] contiguous float32; out [batch, Hq, D]. Returns
 * 0, or -1 for a layer outside the pool, or check_write's status (nothing written). */
int kvf_step_attend_f32(const kvf_step_ctx *c, int layer, const float *q, const float *k,
                        const float *v, float *out) {
    if (layer < 0 || layer >= c->layers) return -1;
    const int window = c->windows ? c->windows[layer] : 0;
    const float softcap = c->softcaps ? c->softcaps[layer] : 0.0f;
    if (c->kv16)
        return kvf_write_decode_f32_bf16kv(q, k, v, (uint16_t *)c->kv + (size_t)layer * (size_t)c->layer_elems,
                                           c->rows, c->layer_rows, c->indptr, c->indices, c->lens,
                                           out, c->batch, c->hq, c->hkv, c->dim, c->page_size,
                                           c->scale, c->n_indices, window, softcap);
    return kvf_write_decode_f32(q, k, v, (float *)c->kv + (size_t)layer * (size_t)c->layer_elems, c->rows,
                                c->layer_rows, c->indptr, c->indices, c->lens, out, c->batch,
                                c->hq, c->hkv, c->dim, c->page_size, c->scale, c->n_indices,
                                window, softcap);
}
