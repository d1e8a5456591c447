/* 4-bit and 8-bit GEMV for float32 activations on CPU: out[m, n] = sum_k x[m, k] * w[n, k]
 * for a few rows m (decode batches), reading the weights as GGUF blocks of 32.
 *
 * Built by service/model/native/kernels.py with the system C compiler and loaded through ctypes
 * (the GIL is released for the call). OpenMP resolves to the libgomp torch already loaded,
 * so the kernel shares the calling thread's worker pool.
 *
 * Why: torch's _weight_int4pack_mm_for_cpu is fast for bf16 activations only; with float32
 * (CPUs without AVX512-BF16, where kvfence computes in float32) it ran 6-19x slower than the
 * dense float32 matmul it was meant to beat, so such hosts read ~540 MB of float32 weights a
 * token instead of ~85 MB of blocks.
 *
 * Layout of one output row n (G = k / 32 blocks; the scale arrays hold G rounded up to a
 * multiple of 8, the padding 0, so they convert 8 at a time):
 *   4-bit: G x 16 bytes of nibbles, then G fp16 scales d, then G fp16 minimums m; byte j
 *          of a block holds element j (low nibble) and j + 16 (high), as ggml's Q4_0/Q4_1
 *          do, and w = d * q + m.
 *   8-bit (q8): G x 32 int8 q, then G fp16 scales d; w = d * q (ggml's Q8_0).
 * The wide layouts (KVF_WIDE) hold GGUF's K-quants, whose sub-block scales are float32
 * products (the super-block's fp16 scale times a 6-bit or int8 integer) fp16 cannot hold:
 *   4-bit wide: G x 16 bytes of nibbles as above, then G float32 scales, then G float32
 *          minimums (Q4_K: sub-blocks of 32 with a scale and a minimum each);
 *   8-bit wide: G x 32 int8 q, then G float32 scales of codes 0-15 of each block, then G
 *          of codes 16-31 (Q6_K: sub-blocks of 16 with a scale each).
 * Then sum_k x_k w_k = sum_blocks (d * sum_j q_j x_j + m * sum_j x_j). The x sums are
 * float32, taken once per call. For sum_j q_j x_j the SIMD path rounds each block of x to
 * int16 with its own scale s = max|x| / 32767 (relative error <= 2^-16 of the block's largest
 * value, 128x finer than rounding x to bf16) and multiplies in exact integer arithmetic
 * (vpmaddwd): |sum| <= 32 * 128 * 32767 < 2^31. The plain C path multiplies in float32.
 * NOTE: measured on SmolLM2-135M against transformers in float32 (make parity): decode
 * logits within 0.01, greedy tokens identical. A second int16 part for the remainder
 * (2^-31, float32 parity) made the B=1 forward ~35% slower on a 2-core AVX2 EPYC.
 */
#include "common.h"
#include "rows.h"
#include "q4_rows.h"
#include "q8_rows.h"
#include "row_loop.h"
#include "amx.h"
#include "panels.h"
#include "panels_amx.h"
#include "panel_gemv.h"
#include "gemv.h"
#include "attend.h"
#include "lora_loops.h"
#include "lora.h"
#include "mlp.h"
#include "moe.h"
#include "stack.h"
