/* The attention glue: the callback through which kvf_decoder_stack hands each layer's q,
 * k and v to kvcache (kvcache.attention.NativeAttend), and the columns of the per-layer
 * tables the stack shares with its caller (service/model/native/kernels.py).
 * Part of kvf.c (one translation unit). */

/* kvcache's attention for one layer of an all-decode step (kvcache.attention.NativeAttend):
 * stores the layer's K/V at the step's rows and attends; 0, or -1 with nothing written. */
typedef int (*attend_fn)(const void *ctx, int layer, const float *q, const float *k,
                         const float *v, float *out);

/* Per layer, the columns of kvf_decoder_stack's table (int64 each: pointers and flags). */
enum { T_QKV, T_QKV_Q8, T_ATTN_NORM, T_O, T_O_Q8, T_MLP_NORM, T_GATE_UP, T_GATE_UP_Q8, T_DOWN,
       T_DOWN_Q8, T_COLUMNS };

/* Per layer, the columns of kvf_decoder_stack's block table (int64 each): what a family's
 * layer has beyond the plain Llama layer, each a float32 pointer or 0 for none, and the
 * layer's RoPE base.
 *   B_QKV_BIAS [q + 2 kv]    added to the qkv product (Qwen2);
 *   B_QK_NORM [hq + hkv, d]  each q and k head RMS-normalized and scaled by its row (Qwen3,
 *                            Gemma 3), after the bias, before RoPE;
 *   B_ROPE                   which of the step's RoPE tables the layer's q and k turn by;
 *   B_O_BIAS [hidden], B_GATE_UP_BIAS [2 inter], B_DOWN_BIAS [hidden]: added to the product;
 *   B_POST_ATTN, B_POST_MLP [hidden]: the o and down products RMS-normalized and scaled by
 *                            these before their residual add (Gemma's sandwich norms);
 *   B_ROUTER [experts, hidden], B_EXPERTS [experts, E_COLUMNS] int64, B_EXPERT_COUNT,
 *   B_TOP_K, B_NORM_TOP_K:   a mixture-of-experts MLP in place of the dense one (Mixtral,
 *                            Qwen3-MoE; experts_mlp), B_EXPERTS 0 for none. */
enum { B_QKV_BIAS, B_QK_NORM, B_ROPE, B_O_BIAS, B_GATE_UP_BIAS, B_DOWN_BIAS, B_POST_ATTN,
       B_POST_MLP, B_ROUTER, B_EXPERTS, B_EXPERT_COUNT, B_TOP_K, B_NORM_TOP_K, B_COLUMNS };

/* Per expert, the columns of a layer's expert table (B_EXPERTS): its gate_up [2 inter, hidden]
 * and down [hidden, inter] weights and their q8 flags, as the table's T_GATE_UP..T_DOWN_Q8. */
enum { E_GATE_UP, E_GATE_UP_Q8, E_DOWN, E_DOWN_Q8, E_COLUMNS };

/* The most experts a layer may have: a row's router logits are kept on the stack. */
#define MAX_EXPERTS 1024

int kvf_stack_max_experts(void) { return MAX_EXPERTS; }

int kvf_stack_block_columns(void) { return B_COLUMNS; }

int kvf_stack_columns(void) { return T_COLUMNS; }
