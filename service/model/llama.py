"""A Llama-family decoder (Llama, Qwen2, Qwen3) in plain torch.

Attention never happens here: every layer hands its RoPE'd q, k, v to the ``attn`` callable
(``kvcache.attention.AttentionFn``), which owns all KV memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.attention import AttentionFn
from service.model.config import ModelConfig
from service.model.packed import Linear, PackedLinears
from service.model.rope import cos_sin_table, inv_freq


@dataclass(slots=True)
class DecoderWeights:
    """Per-layer weights stacked along a leading layer axis, already fused for speed."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor | None  # [V, H]; None when tied to `embed`
    final_norm: torch.Tensor  # [H]
    attn_norm: torch.Tensor  # [L, H]
    qkv: torch.Tensor  # [L, q + 2*kv, H]  (q, k, v rows concatenated)
    qkv_bias: torch.Tensor | None  # [L, q + 2*kv]
    qk_norm: torch.Tensor | None  # [L, Hq + Hkv, D]: q-norm row per q head, k-norm per kv head
    o: torch.Tensor  # [L, H, q]
    mlp_norm: torch.Tensor  # [L, H]
    gate_up: torch.Tensor  # [L, 2*I, H]  (gate rows, then up rows)
    down: torch.Tensor  # [L, H, I]
    packed: PackedLinears | None = None  # quantized copies for small batches (--weights)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


class LlamaModel(torch.nn.Module):
    """Decoder-only transformer over a flattened batch of tokens."""

    rope: torch.Tensor  # [max_positions, 2, head_dim] cos / signed sin, set in __init__

    def __init__(
        self,
        config: ModelConfig,
        weights: DecoderWeights,
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed = _param(weights.embed)
        self.lm_head: torch.nn.Parameter = (
            self.embed if weights.lm_head is None else _param(weights.lm_head)
        )
        self.final_norm = _param(weights.final_norm)
        self.attn_norm = _param(weights.attn_norm)
        self.qkv = _param(weights.qkv)
        self.qkv_bias: torch.nn.Parameter | None = (
            None if weights.qkv_bias is None else _param(weights.qkv_bias)
        )
        self.qk_norm: torch.nn.Parameter | None = (
            None if weights.qk_norm is None else _param(weights.qk_norm)
        )
        self.o = _param(weights.o)
        self.mlp_norm = _param(weights.mlp_norm)
        self.gate_up = _param(weights.gate_up)
        self.down = _param(weights.down)
        self.packed = weights.packed
        freqs = inv_freq(config)
        if rope_freq_factors is not None:
            # GGUF files of Llama-3.1+ carry the scaling as per-frequency divisors instead.
            freqs = freqs / rope_freq_factors.float().cpu()
        # NOTE: cos/sin are precomputed once for every position so a step is one gather.
        table = cos_sin_table(freqs, config.max_position_embeddings)
        # NOTE: rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1.., +1..]; folding the sign into
        # the sin table makes RoPE three ops (roll, mul, addcmul) instead of five.
        table[:, 1, : config.head_dim // 2] *= -1
        self.register_buffer("rope", table.to(device=weights.embed.device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids``/``positions``: ``[T]`` int64. Returns ``[N, vocab]`` float32 logits
        for rows ``logits_indices`` of the batch (all ``T`` rows when None)."""
        with torch.no_grad():
            return self._forward(input_ids, positions, attn, logits_indices)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        c = self.config
        t = input_ids.shape[0]
        hq, hkv, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qk_rows = c.q_size + c.kv_size
        hidden = (c.hidden_size,)
        rope = self.rope[positions].to(self.dtype)
        cos, sin = rope[:, 0:1], rope[:, 1:2]  # [T, 1, D], broadcast over heads
        half = d // 2
        # NOTE: decode batches read every weight once per token, so for a few rows the packed
        # integer GEMVs (3-4x fewer bytes) win; larger batches are compute bound and use dense.
        packed = self.packed if self.packed is not None and t <= self.packed.max_rows else None
        dense_only: tuple[Linear | None, ...] = (None,) * c.num_layers
        p_qkv, p_o, p_gate_up, p_down = (
            (dense_only,) * 4
            if packed is None
            else (packed.qkv, packed.o, packed.gate_up, packed.down)
        )
        x = F.embedding(input_ids, self.embed)
        for i in range(c.num_layers):
            h = F.rms_norm(x, hidden, self.attn_norm[i], eps)
            qkv = _linear(h, self.qkv[i], p_qkv[i])
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias[i]
            # q and k heads are normalized and rotated together as one [T, Hq+Hkv, D] block.
            qk = qkv[:, :qk_rows].reshape(t, hq + hkv, d)
            if self.qk_norm is not None:
                qk = F.rms_norm(qk, (d,), None, eps) * self.qk_norm[i]
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
            # Contiguous views so paged backends can copy/launch on them without restriding.
            q = qk[:, :hq].contiguous()
            k = qk[:, hq:].contiguous()
            v = qkv[:, qk_rows:].reshape(t, hkv, d).contiguous()
            out = attn(i, q, k, v)
            x = x + _linear(out.reshape(t, c.q_size), self.o[i], p_o[i])
            h = F.rms_norm(x, hidden, self.mlp_norm[i], eps)
            gate_up = _linear(h, self.gate_up[i], p_gate_up[i])
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, self.down[i], p_down[i])
        if logits_indices is not None:
            x = x[logits_indices]
        x = F.rms_norm(x, hidden, self.final_norm, eps)
        head = self.packed
        small = head.lm_head if head is not None and x.shape[0] <= head.max_rows else None
        return _linear(x, self.lm_head, small).float()


def _linear(x: torch.Tensor, dense: torch.Tensor, packed: Linear | None) -> torch.Tensor:
    return F.linear(x, dense) if packed is None else packed(x)
