"""Greedy equality end to end: kvfence (each backend, eager and graphed) against transformers
on the same tiny random checkpoint.

The oracle is transformers' greedy ``generate`` in float32 (in bf16, transformers' own tokens
drift from its float32 ones as much as any other bf16 implementation's do). Two measures:

- the largest logit error of kvfence's paged path (every step's logits, graphs and FlashInfer
  included) against transformers float32 teacher-forced on kvfence's tokens, held to a fixed
  bound per dtype;
- the tokens. A divergence is excused only as a near tie: the oracle's top-2 logprob gap there
  is below twice the measured logit error (an error that size can flip an argmax only where
  the top two are that close); the tokens after an excused divergence are not compared.
  Anything else is a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# NOTE: bounds on the logit error against float32 transformers. Float32 differs only in
# summation order (~1e-5 on these models). bf16 keeps 8 mantissa bits: on these random
# models, whose logits reach ~10, transformers' own bf16 run is ~0.4-0.6 off its float32 one.
LOGIT_ERROR_BOUND = {torch.float32: 1e-3, torch.bfloat16: 1.0, torch.float16: 0.25}
NEAR_TIE_FLOOR = 1e-3


@dataclass(frozen=True, slots=True)
class Verdict:
    identical: bool
    near_tie_at: int | None  # excused divergence position
    mismatched: int  # tokens differing outside the near-tie rule

    @property
    def ok(self) -> bool:
        return self.mismatched == 0


def compare(
    reference: Sequence[int], gaps: Sequence[float], other: Sequence[int], tol: float
) -> Verdict:
    """``gaps[i]``: the reference's top-2 logprob gap at position ``i``."""
    if list(reference) == list(other):
        return Verdict(True, None, 0)
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            if gaps[i] < tol:
                return Verdict(False, i, 0)
            rest = sum(1 for x, y in zip(reference[i:], other[i:], strict=False) if x != y)
            return Verdict(False, None, rest + abs(len(reference) - len(other)))
    return Verdict(False, None, abs(len(reference) - len(other)))


def hf_greedy(hf: Any, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and its top-2 logprob gap at each of them."""
    device = next(hf.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        tokens = out[0, len(prompt) :].tolist()
        logits = hf(input_ids=out[:, :-1]).logits[0, len(prompt) - 1 :].float()
    top2 = torch.log_softmax(logits, dim=-1).topk(2, dim=-1).values
    return tokens, (top2[:, 0] - top2[:, 1]).tolist()


def hf_teacher_logits(hf: Any, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """transformers' float32 logits predicting each of ``tokens`` after ``prompt``: [n, V]."""
    device = next(hf.parameters()).device
    ids = torch.tensor([[*prompt, *tokens[:-1]]], device=device)
    with torch.inference_mode():
        return hf(input_ids=ids).logits[0, len(prompt) - 1 :].float().cpu()
