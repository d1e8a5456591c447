"""The interface between the model and KV memory.

The model never touches KV tensors. For every layer it hands the step's freshly
projected (and RoPE'd) q, k, v to an :class:`AttentionFn`, which writes k/v into the
sequence's own pages and returns the attention output. Only ``kvcache`` implements it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionFn(Protocol):
    """Attention for one forward step over a flattened batch of T tokens.

    ``q``: ``[T, num_q_heads, head_dim]``; ``k``, ``v``: ``[T, num_kv_heads, head_dim]``.
    Returns ``[T, num_q_heads, head_dim]`` in ``q``'s dtype, softmax scale ``head_dim**-0.5``,
    causal within each sequence. Implementations store k/v for later steps.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...
