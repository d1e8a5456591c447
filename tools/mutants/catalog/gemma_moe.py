"""Switch-offs of what GGUF tokenizers, pullable models and the Gemma / MoE families guarantee."""

from tools.mutants.mutant import edit, mutant

T_TOK = "tests/model/test_gguf_tokenizer.py"
T_FAM = "tests/model/test_families_gemma_moe.py"

MUTANTS = (
    mutant(
        "unknown-pre-name-guessed",
        "a GGUF BPE vocabulary whose tokenizer.ggml.pre name is unknown is refused, not split as GPT-2",
        edit("service/model/pretokenizers.py", "    splits = SPLITS.get(pre)\n",
             '    splits = SPLITS.get(pre, SPLITS["gpt-2"])\n'),
        tests=f"{T_TOK}::test_an_unknown_or_missing_pre_name_is_refused_by_name",
    ),
    mutant(
        "spm-space-prefix-dropped",
        "a SentencePiece vocabulary with add_space_prefix encodes text with its leading '▁'",
        edit("service/model/gguf_tokenizer.py", "    prefix = v.add_space_prefix is not False\n",
             "    prefix = False\n"),
        tests=f"{T_TOK}::test_a_sentencepiece_vocab_encodes_and_decodes_like_sentencepiece",
    ),
    mutant(
        "moe-top-k-not-renormalised",
        "Mixtral renormalises its top-k routing weights to sum to one",
        edit("service/model/moe.py", "    if routing.normalize_top_k:\n", "    if False:\n"),
        tests="tests/model/test_moe.py",
    ),
    mutant(
        "gemma-output-norms-skipped",
        "Gemma normalises the attention and MLP outputs before each residual add",
        edit("service/model/decoder.py",
             "        x.add_(m if post is None else F.rms_norm(m, hidden, post[i, 1], eps))",
             "        x.add_(m)"),
        tests=f"{T_FAM}::test_each_family_matches_transformers_shorter_and_longer_than_the_window",
    ),
    mutant(
        "pulled-model-unverified",
        "a pulled model whose assembled file misses the pinned sha256 is not installed",
        edit("service/model/catalog.py", "        if digest != model.sha256:\n",
             "        if False:\n"),
        tests="tests/model/test_catalog.py::test_a_chunk_out_of_place_installs_nothing",
    ),
    mutant(
        "gguf-stacked-experts-misread",
        "each expert of a llama.cpp MoE GGUF is its own entry of the stacked ffn_*_exps tensor",
        edit("service/model/gguf_loader.py",
             "        data = raw.data if expert < 0 else raw.data[expert]\n",
             "        data = raw.data if expert < 0 else raw.data[0]\n"),
        tests=f"{T_FAM}::test_a_llama_cpp_moe_gguf_matches_transformers_on_its_hf_checkpoint",
    ),
)
