"""The shared decoder every registered family (:mod:`service.model.families`) runs on, in
plain torch: RMSNorm, RoPE, GQA attention through kvcache, a gated SiLU MLP, each with the
optional pieces its :class:`ModelConfig` names (biases, q/k norm, RoPE scaling).

Attention never happens here: every layer hands its RoPE'd q, k, v to the ``attn`` callable
(``kvcache.attention.AttentionFn``), which owns all KV memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvcache.attention import AttentionFn, NativeAttend
from service.model.invariance import invariant_packs
from service.model.layers import Layer, dense, layers, normed, stack
from service.model.lora_batch import LoraBatch, lora_qkv, lora_rest
from service.model.model_config import ModelConfig
from service.model.moe import Activation, MoeRouting, experts_mlp
from service.model.native.kernels import StackDelta
from service.model.packed import Linear, PackedLinears
from service.model.rope import attention_factor, cos_sin_table, inv_freq


class StackFn(Protocol):
    """Every decoder layer of an all-decode step in one call
    (:class:`~service.model.native.kernels.DecoderStack`): ``x`` updated in place and returned,
    ``rope`` the rows' RoPE rows (``[tables, T, 2, D]`` where layers turn by several bases),
    with ``lora`` the step's adapter deltas by fused projection (None: base rows only)."""

    def __call__(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        attend: NativeAttend,
        lora: Mapping[str, StackDelta] | None = None,
    ) -> torch.Tensor: ...


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
    o_bias: torch.Tensor | None = None  # [L, H]
    gate_up_bias: torch.Tensor | None = None  # [L, 2*I]
    down_bias: torch.Tensor | None = None  # [L, H]
    post_norms: torch.Tensor | None = None  # [L, 2, H]: attention-output, MLP-output norms
    router: torch.Tensor | None = None  # [L, E, H]
    experts_gate_up: torch.Tensor | None = None  # [L, E, 2*I, H]
    experts_down: torch.Tensor | None = None  # [L, E, H, I]


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def _optional(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if t is None else _param(t)


class DecoderModel(torch.nn.Module):
    """Decoder-only transformer over a flattened batch of tokens."""

    rope: torch.Tensor  # [max_positions, 2, head_dim] cos / signed sin, set in __init__

    def __init__(
        self,
        config: ModelConfig,
        weights: DecoderWeights,
        rope_freq_factors: torch.Tensor | None = None,
        batch_invariant: bool = False,
    ) -> None:
        """``batch_invariant``: every step, of any size or mix of prefill and decode, runs
        each token through the same native calls (:func:`invariant_packs`), so a token's
        arithmetic does not depend on the batch; raises ValueError where the weights do not
        allow it (see ``docs/batch-invariance.md``)."""
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
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
        self.o_bias = _optional(weights.o_bias)
        self.gate_up_bias = _optional(weights.gate_up_bias)
        self.down_bias = _optional(weights.down_bias)
        self.post_norms = _optional(weights.post_norms)
        self.router = _optional(weights.router)
        self.experts_gate_up = _optional(weights.experts_gate_up)
        self.experts_down = _optional(weights.experts_down)
        self.routing = (
            MoeRouting(config.num_experts, config.experts_per_token, config.normalize_top_k)
            if config.num_experts
            else None
        )
        self.packed = invariant_packs(weights.packed) if batch_invariant else weights.packed
        self._plain = config.plain_layers  # read once: the property is per layer per step
        rope = self._rope_table(config, config.rope_theta, rope_freq_factors, weights.embed)
        self.register_buffer("rope", rope, persistent=False)
        # Per-layer RoPE bases (Gemma 3's local and global layers): one table per base.
        thetas = config.layer_rope_thetas
        tables = {config.rope_theta: rope}
        for theta in thetas:
            if theta not in tables:
                tables[theta] = self._rope_table(config, theta, rope_freq_factors, weights.embed)
        self._rope_bases = tuple(sorted(tables, key=lambda b: b != config.rope_theta))
        self._ropes = tuple(tables[b] for b in self._rope_bases)
        self._layer_rope = tuple(self._rope_bases.index(b) for b in thetas)
        # NOTE: indexing the stacked weights and choosing dense or packed per layer is done
        # here once; a step then walks a tuple instead of issuing ~6 select ops per layer.
        # Nothing moves the model after construction, so these views stay valid.
        self._dense_layers = layers(self, None)
        self._small_layers = layers(self, self.packed)
        self._max_packed_rows = 0 if self.packed is None else self.packed.max_rows
        # Dense projections stored narrower than the compute dtype (--dtype auto on a bf16 CPU
        # with 4-bit decode weights): the dense head gets a copy in their dtype too.
        dense_dtype = self.qkv.dtype
        head = self.lm_head if self.lm_head.dtype == dense_dtype else self.lm_head.to(dense_dtype)
        self._dense_head = dense(head, self.dtype)
        small_head = None if self.packed is None else self.packed.lm_head
        self._small_head = self._dense_head if small_head is None else small_head
        self._normed_small_head = normed(small_head, self.final_norm, config.rms_norm_eps)
        self._stack: StackFn | None = stack(self, self.packed)
        if batch_invariant and self._stack is None:
            raise ValueError("batch invariance needs every layer on the native decoder stack")

    @staticmethod
    def _rope_table(
        config: ModelConfig, theta: float, factors: torch.Tensor | None, like: torch.Tensor
    ) -> torch.Tensor:
        freqs = inv_freq(dataclasses.replace(config, rope_theta=theta))
        if factors is not None:
            # GGUF files of Llama-3.1+ carry the scaling as per-frequency divisors instead.
            freqs = freqs / factors.float().cpu()
        # NOTE: cos/sin are precomputed once for every position so a step is one gather.
        table = cos_sin_table(freqs, config.max_position_embeddings)
        # NOTE: rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1.., +1..]; folding the sign into
        # the sin table makes RoPE three ops (roll, mul, addcmul) instead of five.
        table[:, 1, : config.head_dim // 2] *= -1
        table *= attention_factor(config)  # yarn / longrope scale cos and sin alike
        # Stored in the compute dtype: the same values the step used to convert on every call.
        return table.to(device=like.device, dtype=like.dtype)

    def layer_rope_table(self, layer: int) -> int:
        """Which RoPE table (one per base, the model's own base first) ``layer`` turns by."""
        return self._layer_rope[layer] if self._layer_rope else 0

    @property
    def stack(self) -> StackFn | None:
        """The native decoder stack that all-decode steps run through; None where the layer
        loop runs every step."""
        return self._stack

    def use_stack(self, fn: StackFn | None) -> None:
        """Run all-decode steps through ``fn`` instead (None: the layer loop). Tests compare
        the two paths and wrap the stack to see which steps it ran."""
        self._stack = fn

    @property
    def small_layers(self) -> tuple[Layer, ...]:
        """Per layer, the projections that decode-sized batches run: the packed weights,
        with what the native kernel fuses, where the model has them."""
        return self._small_layers

    @property
    def normed_small_head(self) -> Linear | None:
        """The final norm and the packed head in one native call, where the kernel fuses them."""
        return self._normed_small_head

    @property
    def max_packed_rows(self) -> int:
        """The largest batch (in tokens) the packed decode weights serve; 0 without them,
        and 0 where every batch runs on the same weights (``batch_invariant``): the
        scheduler's cost model then has one regime."""
        return 0 if self.batch_invariant else self._max_packed_rows

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache is stored in: the dense projections' dtype. Under float32
        compute beside bf16 dense weights (``--dtype auto`` on a bf16 CPU) that is bf16:
        decode attention reads half the bytes, widened to float32 as it reads them.
        NOTE: measured on a 2-core Xeon (AMX), SmolLM2-135M at ~200 keys a sequence: a
        decode row's attention read ~8.8 MB of float32 KV a step, ~0.7 ms of a step's
        ~1 ms per extra row from 8 rows up."""
        return self.qkv.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """``input_ids``/``positions``: ``[T]`` int64. Returns ``[N, vocab]`` float32 logits
        for rows ``logits_indices`` of the batch (all ``T`` rows when None). ``lora``: the
        adapters of the rows that have one (service/model/lora_batch.py)."""
        with torch.no_grad():
            return self._forward(input_ids, positions, attn, logits_indices, lora)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        c = self.config
        t = input_ids.shape[0]
        hq, hkv, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qk_rows = c.q_size + c.kv_size
        hidden = (c.hidden_size,)
        rope = self.rope[positions]
        rows = [rope] + [table[positions] for table in self._ropes[1:]]
        # [T, 1, D] cos / sin per RoPE base, broadcast over heads
        cos_sin = [(r[:, 0:1], r[:, 1:2]) for r in rows]
        half = d // 2
        # NOTE: decode batches read every weight once per token, so for a few rows the packed
        # integer GEMVs (3-4x fewer bytes) win; larger batches are compute bound and use dense.
        small = t <= self._max_packed_rows
        layers = self._small_layers if small else self._dense_layers
        x = F.embedding(input_ids, self.embed)
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        # An all-decode float32 step whose attention kvcache offers to native code runs every
        # layer in one native call (the same calls as the loop below, without Python between).
        native: Callable[..., NativeAttend | None] | None = getattr(attn, "native_attend", None)
        # A step with adapter rows runs the stack with each projection's stacked, masked
        # delta (added inside the native call); where they cannot be had in that form, the
        # layer loop below adds them (the fused calls have no point to add a delta at).
        deltas = None if lora is None else lora.stack_deltas(t)
        stack = self._stack if small and (lora is None or deltas is not None) else None
        # Batch-invariant: every token, prefill or decode, a decode-kernel row of the native
        # stack (kvcache's steps on CPU always offer it). An attention without a native path
        # (DenseAttention: parity, tests) runs per layer below, on the same projections.
        plan = None if stack is None or native is None else native(hq, self.batch_invariant)
        if stack is not None and plan is not None:
            stack(x, rope if len(rows) == 1 else torch.stack(rows), plan, deltas)
        for i, layer in enumerate(() if plan is not None else layers):
            if layer.roped_qkv is not None and lora is None:
                # norm, projection and RoPE of the q and k heads in one native call
                qkv = layer.roped_qkv(x, rope)
                q = qkv[:, : c.q_size].reshape(t, hq, d).contiguous()
                k = qkv[:, c.q_size : qk_rows].reshape(t, hkv, d).contiguous()
            else:
                if lora is not None:
                    qkv = lora_qkv(i, layer, x, lora, eps)
                elif layer.normed_qkv is not None:
                    qkv = layer.normed_qkv(x)  # the norm runs inside the GEMV call
                else:
                    qkv = layer.qkv(F.rms_norm(x, hidden, layer.attn_norm, eps))
                if layer.qkv_bias is not None:
                    qkv += layer.qkv_bias
                # q and k heads are normalized and rotated together as one [T, Hq+Hkv, D] block.
                qk = qkv[:, :qk_rows].reshape(t, hq + hkv, d)
                if layer.qk_norm is not None:
                    qk = F.rms_norm(qk, (d,), None, eps) * layer.qk_norm
                cos, sin = cos_sin[self._layer_rope[i] if self._layer_rope else 0]
                qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
                # Contiguous views so paged backends can copy/launch on them without restriding.
                q = qk[:, :hq].contiguous()
                k = qk[:, hq:].contiguous()
            if c.query_scale != 1.0:
                q = q * c.query_scale
            v = qkv[:, qk_rows:].reshape(t, hkv, d).contiguous()
            out = attn(i, q, k, v).reshape(t, c.q_size)
            if not self._plain:
                self._gemma_or_moe_rest(i, layer, out, x)
                continue
            if lora is not None:
                lora_rest(i, layer, out, x, lora, eps)
                continue
            if layer.mlp_into is not None:
                layer.mlp_into(out, x)  # o, residual, norm, gate/up, SiLU, down: one call
                continue
            # The residual stream ``x`` is this forward's own tensor: add in place (no new
            # buffer), inside the GEMV call where the kernel takes it.
            if layer.o_into is not None:
                layer.o_into(out, x)
            else:
                x.add_(layer.o(out))
            if layer.o_bias is not None:
                x.add_(layer.o_bias)
            if layer.normed_gate_up is not None:
                gate_up = layer.normed_gate_up(x)
            else:
                gate_up = layer.gate_up(F.rms_norm(x, hidden, layer.mlp_norm, eps))
            if layer.gate_up_bias is not None:
                gate_up = gate_up + layer.gate_up_bias
            if layer.gated_down_into is not None:
                layer.gated_down_into(gate_up, x)  # silu(gate) * up inside the GEMV call
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                x.add_(layer.down(F.silu(gate).mul_(up)))
            if layer.down_bias is not None:
                x.add_(layer.down_bias)
        if logits_indices is not None:
            x = x[logits_indices]
        if x.shape[0] <= self._max_packed_rows and self._normed_small_head is not None:
            return self._softcapped(self._normed_small_head(x))
        x = F.rms_norm(x, hidden, self.final_norm, eps)
        head = self._small_head if x.shape[0] <= self._max_packed_rows else self._dense_head
        return self._softcapped(head(x).float())

    def _softcapped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def _gemma_or_moe_rest(self, i: int, layer: Layer, out: torch.Tensor, x: torch.Tensor) -> None:
        """A layer's rest after attention where it is not the plain Llama layer: the output
        projection, then the MLP (dense or experts), each with its output norm (Gemma)."""
        c = self.config
        hidden, eps = (c.hidden_size,), c.rms_norm_eps
        a = layer.o(out)
        if layer.o_bias is not None:
            a = a + layer.o_bias
        post = self.post_norms
        x.add_(a if post is None else F.rms_norm(a, hidden, post[i, 0], eps))
        h = F.rms_norm(x, hidden, layer.mlp_norm, eps)
        act = _ACTIVATIONS[c.activation]
        if self.routing is not None:
            assert self.router is not None
            # the experts' packs on decode-sized batches, as the dense MLP's (Layer)
            m = experts_mlp(
                h, self.router[i], layer.experts_gate_up, layer.experts_down, self.routing, act
            )
        else:
            gate_up = layer.gate_up(h)
            if layer.gate_up_bias is not None:
                gate_up = gate_up + layer.gate_up_bias
            gate, up = gate_up.chunk(2, dim=-1)
            m = layer.down(act(gate) * up)
            if layer.down_bias is not None:
                m = m + layer.down_bias
        x.add_(m if post is None else F.rms_norm(m, hidden, post[i, 1], eps))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Activation] = {"silu": F.silu, "gelu_tanh": _gelu_tanh}
