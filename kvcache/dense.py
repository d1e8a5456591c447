"""Contiguous (non-paged) reference attention for a single sequence.

Used as the oracle in tests and by model-only code paths that have no page pool.
It keeps one growing K/V tensor per layer; it is not used by the serving engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Dense causal GQA attention.

    ``q``: ``[Tq, Hq, D]`` for positions ``q_start .. q_start+Tq-1``; ``k``, ``v``:
    ``[Tk, Hkv, D]`` for positions ``0 .. Tk-1``. Query i attends to keys ``<= q_start + i``,
    and with a ``window`` > 0 only to the last ``window`` of them (``> q_start + i - window``).
    A ``softcap`` > 0 takes each scaled score ``s`` as ``softcap * tanh(s / softcap)``.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    kx = k.repeat_interleave(group, dim=1)
    vx = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kx.float()) * (d**-0.5)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(q_start, q_start + tq, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    hidden = kpos > qpos
    if window > 0:
        hidden = hidden | (kpos <= qpos - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, vx.float())
    return out.to(q.dtype)


class DenseAttention:
    """An :class:`~kvcache.attention.AttentionFn` for one sequence with contiguous KV."""

    def __init__(
        self, num_layers: int, windows: Sequence[int] = (), softcaps: Sequence[float] = ()
    ) -> None:
        """``windows``: each layer's window (0 = every earlier key); empty = all full.
        ``softcaps``: each layer's logit softcap (0 = none); empty = none."""
        self._windows = tuple(windows) or (0,) * num_layers
        self._softcaps = tuple(softcaps) or (0.0,) * num_layers
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        prev_k, prev_v = self._k[layer], self._v[layer]
        q_start = 0 if prev_k is None else prev_k.shape[0]
        full_k = k if prev_k is None else torch.cat([prev_k, k], dim=0)
        full_v = v if prev_v is None else torch.cat([prev_v, v], dim=0)
        self._k[layer], self._v[layer] = full_k, full_v
        return causal_attention(
            q, full_k, full_v, q_start, self._windows[layer], self._softcaps[layer]
        )
