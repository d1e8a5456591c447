"""A Llama-family decoder (Llama, Qwen2, Qwen3) in plain torch.

Attention never happens here: every layer hands its RoPE'd q, k, v to the ``attn`` callable
(``kvcache.attention.AttentionFn``), which owns all KV memory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.attention import AttentionFn, NativeAttend
from service.model.config import ModelConfig
from service.model.native_gemv import DecoderStack, MlpBlock, Q4Linear, Rope, StackLayer
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
        self.packed = invariant_packs(weights.packed) if batch_invariant else weights.packed
        freqs = inv_freq(config)
        if rope_freq_factors is not None:
            # GGUF files of Llama-3.1+ carry the scaling as per-frequency divisors instead.
            freqs = freqs / rope_freq_factors.float().cpu()
        # NOTE: cos/sin are precomputed once for every position so a step is one gather.
        table = cos_sin_table(freqs, config.max_position_embeddings)
        # NOTE: rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1.., +1..]; folding the sign into
        # the sin table makes RoPE three ops (roll, mul, addcmul) instead of five.
        table[:, 1, : config.head_dim // 2] *= -1
        # Stored in the compute dtype: the same values the step used to convert on every call.
        rope = table.to(device=weights.embed.device, dtype=weights.embed.dtype)
        self.register_buffer("rope", rope, persistent=False)
        # NOTE: indexing the stacked weights and choosing dense or packed per layer is done
        # here once; a step then walks a tuple instead of issuing ~6 select ops per layer.
        # Nothing moves the model after construction, so these views stay valid.
        self._dense_layers = _layers(self, None)
        self._small_layers = _layers(self, self.packed)
        self._max_packed_rows = 0 if self.packed is None else self.packed.max_rows
        # Dense projections stored narrower than the compute dtype (--dtype auto on a bf16 CPU
        # with 4-bit decode weights): the dense head gets a copy in their dtype too.
        dense_dtype = self.qkv.dtype
        head = self.lm_head if self.lm_head.dtype == dense_dtype else self.lm_head.to(dense_dtype)
        self._dense_head = _dense(head, self.dtype)
        small_head = None if self.packed is None else self.packed.lm_head
        self._small_head = self._dense_head if small_head is None else small_head
        self._normed_small_head = _normed(small_head, self.final_norm, config.rms_norm_eps)
        self._stack = _stack(self, self.packed)
        if batch_invariant and self._stack is None:
            raise ValueError("batch invariance needs every layer on the native decoder stack")

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
        rope = self.rope[positions]
        cos, sin = rope[:, 0:1], rope[:, 1:2]  # [T, 1, D], broadcast over heads
        half = d // 2
        # NOTE: decode batches read every weight once per token, so for a few rows the packed
        # integer GEMVs (3-4x fewer bytes) win; larger batches are compute bound and use dense.
        small = t <= self._max_packed_rows
        layers = self._small_layers if small else self._dense_layers
        x = F.embedding(input_ids, self.embed)
        # An all-decode float32 step whose attention kvcache offers to native code runs every
        # layer in one native call (the same calls as the loop below, without Python between).
        native: Callable[..., NativeAttend | None] | None = getattr(attn, "native_attend", None)
        stack = self._stack if small else None
        # Batch-invariant: every token, prefill or decode, a decode-kernel row of the native
        # stack (kvcache's steps on CPU always offer it). An attention without a native path
        # (DenseAttention: parity, tests) runs per layer below, on the same projections.
        plan = None if stack is None or native is None else native(hq, self.batch_invariant)
        if stack is not None and plan is not None:
            stack(x, rope, plan)
        for i, layer in enumerate(() if plan is not None else layers):
            if layer.roped_qkv is not None:
                # norm, projection and RoPE of the q and k heads in one native call
                qkv = layer.roped_qkv(x, rope)
                q = qkv[:, : c.q_size].reshape(t, hq, d).contiguous()
                k = qkv[:, c.q_size : qk_rows].reshape(t, hkv, d).contiguous()
            else:
                if layer.normed_qkv is not None:
                    qkv = layer.normed_qkv(x)  # the norm runs inside the GEMV call
                else:
                    qkv = layer.qkv(F.rms_norm(x, hidden, layer.attn_norm, eps))
                if layer.qkv_bias is not None:
                    qkv += layer.qkv_bias
                # q and k heads are normalized and rotated together as one [T, Hq+Hkv, D] block.
                qk = qkv[:, :qk_rows].reshape(t, hq + hkv, d)
                if layer.qk_norm is not None:
                    qk = F.rms_norm(qk, (d,), None, eps) * layer.qk_norm
                qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
                # Contiguous views so paged backends can copy/launch on them without restriding.
                q = qk[:, :hq].contiguous()
                k = qk[:, hq:].contiguous()
            v = qkv[:, qk_rows:].reshape(t, hkv, d).contiguous()
            out = attn(i, q, k, v).reshape(t, c.q_size)
            if layer.mlp_into is not None:
                layer.mlp_into(out, x)  # o, residual, norm, gate/up, SiLU, down: one call
                continue
            # The residual stream ``x`` is this forward's own tensor: add in place (no new
            # buffer), inside the GEMV call where the kernel takes it.
            if layer.o_into is not None:
                layer.o_into(out, x)
            else:
                x.add_(layer.o(out))
            if layer.normed_gate_up is not None:
                gate_up = layer.normed_gate_up(x)
            else:
                gate_up = layer.gate_up(F.rms_norm(x, hidden, layer.mlp_norm, eps))
            if layer.gated_down_into is not None:
                layer.gated_down_into(gate_up, x)  # silu(gate) * up inside the GEMV call
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                x.add_(layer.down(F.silu(gate).mul_(up)))
        if logits_indices is not None:
            x = x[logits_indices]
        if x.shape[0] <= self._max_packed_rows and self._normed_small_head is not None:
            return self._normed_small_head(x)
        x = F.rms_norm(x, hidden, self.final_norm, eps)
        head = self._small_head if x.shape[0] <= self._max_packed_rows else self._dense_head
        return head(x).float()


@dataclass(frozen=True, slots=True)
class _Layer:
    """One layer's weights and projections, taken out of the stacked tensors once at load."""

    attn_norm: torch.Tensor
    qkv: Linear
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    # Fused forms where the packed kernel takes them (float32 4-bit/8-bit GEMV): the input
    # RMSNorm, RoPE, the SiLU gate and the residual add run inside the projection's call.
    normed_qkv: Linear | None = None
    roped_qkv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (x, rope)
    o_into: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (v, x): x +=
    normed_gate_up: Linear | None = None
    gated_down_into: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (attn, x): everything from o to the down projection's residual add in one call
    mlp_into: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


# Any batch size works with a packed weight; the hint only picks oneDNN's blocking.
_PREPACK_HINT = 32


def _prepacks(weight: torch.Tensor) -> bool:
    """Whether dense projections run through oneDNN with weights reordered once at load.

    NOTE: measured on a 2-core AVX512-BF16 CPU (30 layers of SmolLM2-135M's projections, bf16):
    ``F.linear`` reorders the weight for oneDNN on every call; the prepacked weight makes the
    layers' matmuls 14.7 vs 25.6 ms at 8 rows, 26.4 vs 42.5 at 32, 78 vs 90 at 128 and
    272 vs 294 at 512. The copy costs the dense weights' size in memory once more. fp32 (the
    parity dtype) keeps ``F.linear``, so parity compares the plain matmul."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def _mkldnn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), weight, None, "none", [], ""
    )
    return out


def _cast(x: torch.Tensor, linear: Linear, dtype: torch.dtype) -> torch.Tensor:
    return linear(x.to(dtype)).to(x.dtype)


def _dense(weight: torch.Tensor, compute: torch.dtype) -> Linear:
    """``x @ weight.T`` for ``x`` in ``compute``; a weight stored in another dtype gets ``x``
    cast to it and the product cast back."""
    if _prepacks(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PREPACK_HINT)
        linear: Linear = functools.partial(_mkldnn_linear, weight=packed)
    else:
        linear = functools.partial(F.linear, weight=weight)
    if weight.dtype == compute:
        return linear
    return functools.partial(_cast, linear=linear, dtype=weight.dtype)


def _layers(model: LlamaModel, packed: PackedLinears | None) -> tuple[_Layer, ...]:
    """Per-layer views and callables; ``packed`` entries replace the dense ones they cover."""

    none: tuple[Linear | None, ...] = (None,) * model.config.num_layers
    qkv, o, gate_up, down = (
        (none,) * 4 if packed is None else (packed.qkv, packed.o, packed.gate_up, packed.down)
    )

    def pick(dense: torch.Tensor, small: Linear | None) -> Linear:
        return _dense(dense, model.dtype) if small is None else small

    c = model.config
    eps = c.rms_norm_eps
    # RoPE runs in the qkv call only where nothing comes between the projection and it
    plain_qk = (
        Rope(c.num_heads + c.num_kv_heads, c.head_dim)
        if model.qkv_bias is None and model.qk_norm is None and model.rope.dtype == torch.float32
        else None
    )

    return tuple(
        _Layer(
            attn_norm=model.attn_norm[i],
            qkv=pick(model.qkv[i], qkv[i]),
            qkv_bias=None if model.qkv_bias is None else model.qkv_bias[i],
            qk_norm=None if model.qk_norm is None else model.qk_norm[i],
            o=pick(model.o[i], o[i]),
            mlp_norm=model.mlp_norm[i],
            gate_up=pick(model.gate_up[i], gate_up[i]),
            down=pick(model.down[i], down[i]),
            normed_qkv=_normed(qkv[i], model.attn_norm[i], eps),
            roped_qkv=None if plain_qk is None else _roped(qkv[i], model.attn_norm[i], eps, plain_qk),
            o_into=_into(o[i]),
            normed_gate_up=_normed(gate_up[i], model.mlp_norm[i], eps),
            gated_down_into=_gated_into(down[i]),
            mlp_into=_mlp(o[i], model.mlp_norm[i], eps, gate_up[i], down[i]),
        )
        for i in range(model.config.num_layers)
    )


def _normed(lin: Linear | None, gamma: torch.Tensor, eps: float) -> Linear | None:
    """``lin(F.rms_norm(x, ..., gamma, eps))`` as one native call where ``lin`` fuses it."""
    if isinstance(lin, Q4Linear) and lin.fuses and gamma.dtype == torch.float32:
        return lin.normed_by(gamma.detach().contiguous(), eps)
    return None


def _roped(
    lin: Linear | None, gamma: torch.Tensor, eps: float, rope: Rope
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``(x, rope rows)``: :func:`_normed`'s call with RoPE on the q and k heads."""
    if isinstance(lin, Q4Linear) and lin.fuses and gamma.dtype == torch.float32:
        return lin.roped_by(gamma.detach().contiguous(), eps, rope)
    return None


def _mlp(
    o: Linear | None,
    gamma: torch.Tensor,
    eps: float,
    gate_up: Linear | None,
    down: Linear | None,
) -> MlpBlock | None:
    """``(attn, x)``: the layer's o projection to its down projection's residual add as one
    native call, where all three are the fusing 4-bit GEMV."""
    if (
        isinstance(o, Q4Linear)
        and isinstance(gate_up, Q4Linear)
        and isinstance(down, Q4Linear)
        and o.fuses
        and gate_up.fuses
        and down.fuses
        and gamma.dtype == torch.float32
    ):
        return MlpBlock(o, gamma.detach().contiguous(), eps, gate_up, down)
    return None


def _into(lin: Linear | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``(v, x)``: ``x += lin(v)`` as one native call where ``lin`` takes it."""
    return lin.into if isinstance(lin, Q4Linear) else None


def _gated_into(
    lin: Linear | None,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``(gate_up, x)``: ``x += lin(F.silu(gate) * up)`` as one native call where ``lin``
    fuses it."""
    if isinstance(lin, Q4Linear) and lin.fuses:
        return lin.gated_into
    return None


def invariant_packs(packed: PackedLinears | None) -> PackedLinears:
    """``packed`` for batch-invariant steps: every projection and the head on kvfence's
    float32 GEMV with the tile unit off, for batches of any size up to the kernel's row
    limit. Each row's input is rounded to int16 per block of 32 on its own (no look across
    rows), and its sums run over the blocks in one order whatever the batch (the kernel's
    one-row loop and its 4-row tiles do the same arithmetic), so a row's output does not
    depend on the rows beside it. Raises ValueError where a weight is not on that kernel.
    NOTE: measured on a 2-core AMX Xeon (SmolLM2-135M, 30 layers' projections and the
    head, shared machine): the tile unit ran 1 row in ~2x the GEMV's time, so one kernel
    for every batch size had to be this one for single-stream decode to keep its speed."""
    every = () if packed is None else (*packed.qkv, *packed.o, *packed.gate_up, *packed.down)
    if packed is None or not all(isinstance(lin, Q4Linear) for lin in (*every, packed.lm_head)):
        raise ValueError("batch invariance needs every projection on the 4-bit GEMV kernel")

    def plain(lin: Linear | None) -> Q4Linear:
        assert isinstance(lin, Q4Linear)
        return dataclasses.replace(lin, tiles=False)

    def layer(lins: tuple[Linear | None, ...]) -> tuple[Linear | None, ...]:
        return tuple(plain(lin) for lin in lins)

    head = plain(packed.lm_head)
    return PackedLinears(
        qkv=layer(packed.qkv),
        o=layer(packed.o),
        gate_up=layer(packed.gate_up),
        down=layer(packed.down),
        lm_head=head,
        max_rows=head.kernel.max_rows,
    )


def _stack(model: LlamaModel, packed: PackedLinears | None) -> DecoderStack | None:
    """Every layer as one native call (:class:`DecoderStack`), where each layer's qkv, o,
    gate/up and down are the fusing packed GEMV and RoPE runs in the qkv call."""
    c = model.config
    if (
        packed is None
        or model.qkv_bias is not None
        or model.qk_norm is not None
        or model.rope.dtype != torch.float32
        or model.attn_norm.dtype != torch.float32
    ):
        return None
    layers = []
    for i in range(c.num_layers):
        qkv, o, gate_up, down = packed.qkv[i], packed.o[i], packed.gate_up[i], packed.down[i]
        if not (
            isinstance(qkv, Q4Linear)
            and isinstance(o, Q4Linear)
            and isinstance(gate_up, Q4Linear)
            and isinstance(down, Q4Linear)
            and qkv.fuses
            and o.fuses
            and gate_up.fuses
            and down.fuses
        ):
            return None
        layers.append(
            StackLayer(
                model.attn_norm[i].detach(), qkv, o, model.mlp_norm[i].detach(), gate_up, down
            )
        )
    return DecoderStack(layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
