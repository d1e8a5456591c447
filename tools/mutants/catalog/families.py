"""Switch-offs of the model guarantees: strict loading, the sliding window, the logit softcap."""

from tools.mutants.mutant import edit, mutant

T_STRICT = "tests/model/test_strict_loading.py"
T_WINDOW = "tests/kvcache/test_window.py"
T_SOFTCAP = "tests/kvcache/test_softcap.py"

MUTANTS = (
    mutant(
        "loader-keeps-unused-tensors",
        "a checkpoint holding a tensor the decoder does not compute with is refused, naming it",
        edit("service/model/families/base.py", "    if unused:\n", "    if False:\n"),
        tests=(
            f"{T_STRICT}::test_a_gguf_tensor_no_decoder_tensor_comes_from_is_refused_by_name",
            f"{T_STRICT}::test_fp8_scales_without_the_config_are_refused_as_unused_tensors",
        ),
    ),
    mutant(
        "loader-ignores-config-keys",
        "a config key that changes the arithmetic is honoured or refused by name",
        edit("service/model/families/keys.py",
             "if k in keys.raw and k not in keys.read and (v := keys.raw[k]) not in neutral",
             "if k in keys.raw and k not in keys.read and (v := keys.raw[k]) not in neutral and False"),
        tests=(
            f"{T_STRICT}::test_an_fp8_checkpoint_is_refused_naming_its_quantization_config",
            f"{T_STRICT}::test_a_config_key_the_family_does_not_compute_with_is_refused_by_name",
        ),
    ),
    mutant(
        "o-bias-dropped",
        "an attention output bias in the checkpoint is applied",
        edit("service/model/decoder.py", "            if layer.o_bias is not None:\n                x.add_(layer.o_bias)",
             "            if layer.o_bias is not None:\n                pass"),
        tests=f"{T_STRICT}::test_attention_bias_applies_the_o_proj_bias_and_matches_transformers",
    ),
    mutant(
        "kernel-ignores-window",
        "the C decode kernel reads only a sliding-window layer's last window keys",
        edit("kvcache/backends/cpu_decode.c",
             "const int lo = window > 0 && n > window ? n - window : 0;", "const int lo = 0;"),
        tests=(
            f"{T_WINDOW}::test_the_c_kernel_reads_only_the_window_from_mid_page",
            f"{T_WINDOW}::test_native_model_code_gets_each_layers_window_through_the_step_context",
        ),
    ),
    mutant(
        "torch-prefill-ignores-window",
        "torch prefill chunks of a sliding-window layer attend within the window",
        edit("kvcache/backends/torch_backend.py",
             "            if window > 0:\n                mask &= keys > q_pos - window",
             "            if window < 0:\n                mask &= keys > q_pos - window"),
        tests=f"{T_WINDOW}::test_the_torch_backend_honours_each_layers_window",
    ),
    mutant(
        "kernel-ignores-softcap",
        "the C decode kernel softcaps a softcapped layer's scores before the softmax",
        edit("kvcache/backends/cpu_decode.c",
             "s[g][o] = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;",
             "s[g][o] = dot;"),
        tests=(
            f"{T_SOFTCAP}::test_the_c_kernel_caps_scores_and_refuses_a_cap_below_zero_or_not_finite",
            f"{T_SOFTCAP}::test_native_model_code_gets_each_layers_softcap_through_the_step_context",
        ),
    ),
    mutant(
        "torch-sdpa-ignores-softcap",
        "torch prefill chunks of a softcapped layer cap their scores (no plain SDPA)",
        edit("kvcache/backends/torch_backend.py",
             "        if softcap > 0:\n            out = softcapped_attention(qb, k, v, c.mask, c.causal, softcap)",
             "        if softcap < 0:\n            out = softcapped_attention(qb, k, v, c.mask, c.causal, softcap)"),
        tests=f"{T_SOFTCAP}::test_the_torch_backend_caps_each_layers_scores",
    ),
)
