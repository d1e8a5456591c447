"""FlashInfer's documented paged-KV ``plan``/``run`` contract, in plain torch on CPU.

Lets the FlashInfer backend's CSR building, row splitting and planning order be tested
without a GPU. It also asserts what the backend promises the real library: every option by
keyword, ``indptr``/``last_page_len`` on the host, ``indices`` int32.
"""

from __future__ import annotations

from typing import Any

import torch

PLAN_OPTIONS = {
    "pos_encoding_mode",
    "q_data_type",
    "kv_data_type",
    "sm_scale",
    "causal",
    "window_left",
    "logits_soft_cap",
}


class ReferenceWrapper:
    """``BatchDecodeWithPagedKVCacheWrapper`` (kind "decode") or
    ``BatchPrefillWithPagedKVCacheWrapper`` (kind "prefill") semantics, NHD layout."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.plans = 0
        self.runs = 0

    def plan(self, *args: Any, **options: Any) -> None:
        if self.kind == "decode":
            indptr, indices, last, hq, hkv, d, ps = args
            qo = torch.arange(len(last) + 1, dtype=torch.int32)
            assert "causal" not in options
        else:
            qo, indptr, indices, last, hq, hkv, d, ps = args
            assert options["causal"] is True
        assert set(options) <= PLAN_OPTIONS, set(options) - PLAN_OPTIONS
        assert options["pos_encoding_mode"] == "NONE"
        for t in (qo, indptr, last):
            assert t.device.type == "cpu" and t.dtype == torch.int32
        assert indices.dtype == torch.int32
        self.window_left = int(options.get("window_left", -1))
        self.soft_cap = float(options.get("logits_soft_cap") or 0.0)
        self._plan = (qo, indptr, indices, last, hq, hkv, d, ps, options["sm_scale"])
        self.plans += 1

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        qo, indptr, indices, last, hq, hkv, d, ps, scale = self._plan
        assert q.shape[0] == int(qo[-1]) and q.dtype == kv_layer.dtype
        self.runs += 1
        out = torch.empty_like(q)
        for i in range(len(last)):
            pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
            n = (len(pages) - 1) * ps + int(last[i])
            k = kv_layer[pages, 0].reshape(-1, hkv, d)[:n].float()
            v = kv_layer[pages, 1].reshape(-1, hkv, d)[:n].float()
            qi = q[int(qo[i]) : int(qo[i + 1])].float()
            rows = qi.shape[0]
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
            if self.soft_cap > 0:  # logits_soft_cap: cap * tanh(s / cap)
                scores = torch.tanh(scores / self.soft_cap) * self.soft_cap
            # Causal, bottom-right aligned: query j sits at position n - rows + j.
            pos = torch.arange(n - rows, n)[:, None]
            keys = torch.arange(n)[None, :]
            scores.masked_fill_(keys > pos, float("-inf"))
            if self.window_left >= 0:  # keys pos - window_left .. pos only
                scores.masked_fill_(keys < pos - self.window_left, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[int(qo[i]) : int(qo[i + 1])] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        return out
