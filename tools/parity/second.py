"""Parity of the second pullable model (Gemma 3 270M, Q4_K_M) against transformers.

transformers loads the same GGUF (``gguf_file=``) and dequantizes it itself; kvfence loads it
dense float32. The row passes when, on the same file:

- the tokenizer gives the same ids (BOS included, as the file asks) on the shared corpus;
- greedy continuations of the four parity prompts are the ones transformers would pick;
- chat through the model's own template (service/model/chat_templates.py) renders exactly as
  transformers renders that template, and its greedy continuation is transformers' too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.model import LoadedModel
from tools.parity.checks import GREEDY_TOKENS, greedy_ours, hf_agrees_with_greedy
from tools.parity.corpus import CONVERSATIONS, PROMPTS, tokenizer_corpus


@dataclass(frozen=True, slots=True)
class SecondModelParity:
    greedy: int
    prompts: int
    chat_greedy: int
    chats: int
    chat_rendered: int
    tokenizer: int
    texts: int

    @property
    def ok(self) -> bool:
        return (
            self.greedy == self.prompts
            and self.chat_greedy == self.chats
            and self.chat_rendered == self.chats
            and self.tokenizer == self.texts
        )

    def line(self, label: str) -> str:
        return (
            f"{label}: greedy_identical={self.greedy}/{self.prompts} "
            f"chat_greedy_identical={self.chat_greedy}/{self.chats} "
            f"chat_rendered_identical={self.chat_rendered}/{self.chats} "
            f"tokenizer_match={self.tokenizer}/{self.texts}"
        )


def second_model_parity(
    loaded: LoadedModel,
    hf_model: Any,
    hf_tok: Any,
    *,
    prompts: Sequence[str] = PROMPTS[:4],
    n: int = GREEDY_TOKENS,
) -> SecondModelParity:
    tok = loaded.tokenizer
    texts = tokenizer_corpus()
    same_ids = sum(tok.encode(t, add_special_tokens=True) == hf_tok(t)["input_ids"] for t in texts)
    greedy = 0
    for text in prompts:
        ids = tok.encode(text, add_special_tokens=True)
        greedy += hf_agrees_with_greedy(hf_model, ids, greedy_ours(loaded.model, ids, n))
    template = loaded.chat_template
    assert template is not None, "the second model is served with its own chat template"
    hf_tok.chat_template = template.source
    chats = [c for c in CONVERSATIONS if _alternates(c)]
    rendered = chat_greedy = 0
    for conv in chats:
        ours = template.render(conv, add_generation_prompt=True)
        theirs = hf_tok.apply_chat_template(
            [dict(m) for m in conv], tokenize=False, add_generation_prompt=True
        )
        rendered += ours == theirs
        ids = tok.encode(ours)  # the template writes <bos> itself
        chat_greedy += hf_agrees_with_greedy(hf_model, ids, greedy_ours(loaded.model, ids, n))
    return SecondModelParity(
        greedy, len(prompts), chat_greedy, len(chats), rendered, same_ids, len(texts)
    )


def _alternates(conv: Sequence[Any]) -> bool:
    """Gemma's template takes an optional system turn, then user/assistant alternating."""
    roles = [m["role"] for m in conv if m["role"] != "system" or m is not conv[0]]
    return all(r == ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles))


def load_second(path: Path, template: str | None) -> LoadedModel:
    from service.model import load_model

    return load_model(path, dtype="float32", weights="bf16", progress=False, chat_template=template)
