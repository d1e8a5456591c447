"""Greedy equality end to end: kvfence (each backend, eager and graphed) against transformers
on the same tiny random checkpoint.

The oracle is transformers' own greedy ``generate``. Where kvfence's tokens differ, the
divergence is excused only as a near tie: transformers' top-2 logprob gap at that position
(teacher-forced on its own tokens) is below the tolerance of the dtype (rounding in a
different kernel can flip an argmax only where the top two are that close); the tokens after
an excused divergence are not compared. Anything else is a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# NOTE: the largest logit change a different summation order causes: ~1e-6 in fp32, ~1e-2 in
# bf16 (8 mantissa bits) on these tiny models; a gap above it cannot flip.
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


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
