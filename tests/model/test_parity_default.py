"""Our runtime vs Hugging Face transformers on the default SmolLM2 GGUF (fp32, CPU)."""

from __future__ import annotations

from typing import Any

import pytest

from service.model import LoadedModel
from tools.parity import checks as parity
from tools.parity.corpus import CONVERSATIONS, PROMPTS, tokenizer_corpus

# The default model against the transformers oracle (loading the oracle alone takes minutes
# on 2 busy cores); `make parity` runs the same checks at full size.
pytestmark = pytest.mark.slow


def test_prompts_cover_long_unicode_emoji_and_code(default_model: LoadedModel) -> None:
    lengths = [len(default_model.tokenizer.encode(p)) for p in PROMPTS]
    assert len(PROMPTS) >= 4
    assert max(lengths) >= 300
    assert any("🚀" in p for p in PROMPTS) and any("def " in p for p in PROMPTS)
    assert any("日本語" in p for p in PROMPTS)


def test_logits_match_transformers(default_model: LoadedModel, hf_oracle: tuple[Any, Any]) -> None:
    diff = parity.max_logit_diff(default_model, hf_oracle[0], PROMPTS)
    assert diff <= parity.LOGITS_TOL


@pytest.mark.parametrize("prompt", PROMPTS[:4], ids=["plain", "unicode", "emoji", "code"])
def test_greedy_continuation_identical(
    default_model: LoadedModel, hf_oracle: tuple[Any, Any], prompt: str
) -> None:
    ids = default_model.tokenizer.encode(prompt)
    ours = parity.greedy_ours(default_model.model, ids, parity.GREEDY_TOKENS)
    assert len(ours) == parity.GREEDY_TOKENS
    assert parity.hf_agrees_with_greedy(hf_oracle[0], ids, ours)


def test_tokenizer_matches_transformers(
    default_model: LoadedModel, hf_oracle: tuple[Any, Any]
) -> None:
    corpus = tokenizer_corpus()
    assert len(corpus) >= 200
    assert parity.tokenizer_mismatches(default_model.tokenizer, hf_oracle[1], corpus) == []


def test_special_token_text_encodes_as_one_special_token(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    im_start = tok.encode("<|im_start|>")
    assert im_start == [1] and 1 in tok.special_ids()
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.decode([1, 2], skip_special_tokens=True) == ""


def test_chat_template_matches_transformers(
    default_model: LoadedModel, hf_oracle: tuple[Any, Any]
) -> None:
    assert default_model.chat_template is not None
    assert any(c[0]["role"] == "system" for c in CONVERSATIONS)
    assert any(c[0]["role"] != "system" for c in CONVERSATIONS)
    assert parity.chat_mismatches(default_model.chat_template, hf_oracle[1], CONVERSATIONS) == []


def test_default_config_and_special_ids(default_model: LoadedModel) -> None:
    c = default_model.model.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama",
        30,
        576,
        9,
        3,
        64,
    )
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (49152, 100000.0, True)
    assert default_model.tokenizer.bos_token_id == 1
    assert default_model.tokenizer.eos_token_ids[0] == 2  # <|im_end|>


def test_the_served_configuration_keeps_top1_agreement_with_float32_transformers(
    served_model: LoadedModel, hf_oracle: tuple[Any, Any]
) -> None:
    """The default model at the default dtype and weights (as ``kvfence serve`` loads it)
    against transformers float32 on the same file, teacher-forced on our greedy history:
    the oracle's top-1 is our token at >= 98% of positions (``make parity``'s auto row)."""
    row = parity.decode_parity(served_model, hf_oracle[0], PROMPTS[:4])
    assert row.positions == 4 * parity.GREEDY_TOKENS
    assert row.agree >= parity.SERVED_MIN_AGREEMENT * row.positions, row.line("served")
