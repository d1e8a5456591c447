"""The shared decoder's per-layer callables: each layer's projections (dense or packed) and
the fused native forms the packed 4-bit GEMV offers, picked once at load.

Every family computes on these. A feature the fused forms cannot compute (a bias between
two fused steps) turns that fusion off for the model; the layer loop in
:class:`~service.model.decoder.DecoderModel` then runs the plain form, and the load says so in
a debug log.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch
import torch.nn.functional as F

from service.model.native.kernels import (
    STACK_GATES,
    DecoderStack,
    MlpBlock,
    Q4Linear,
    Rope,
    StackExperts,
    StackLayer,
)
from service.model.packed import Experts, Linear, PackedLinears

if TYPE_CHECKING:
    from service.model.decoder import DecoderModel

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer's weights and projections, taken out of the stacked tensors once at load."""

    attn_norm: torch.Tensor
    qkv: Linear
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    # Fused forms where the packed kernel takes them (float32 4-bit/8-bit GEMV): the input
    # RMSNorm, RoPE, the SiLU gate and the residual add run inside the projection's call.
    normed_qkv: Linear | None = None
    roped_qkv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (x, rope)
    o_into: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (v, x): x +=
    normed_gate_up: Linear | None = None
    gated_down_into: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (attn, x): everything from o to the down projection's residual add in one call
    mlp_into: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # A mixture-of-experts layer's experts' projections (dense or packed), one per expert
    experts_gate_up: Experts = ()
    experts_down: Experts = ()


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
        and weight.numel() > 0  # oneDNN has no primitive for an empty weight (MoE's dense MLP)
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


def dense(weight: torch.Tensor, compute: torch.dtype) -> Linear:
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


def layers(model: DecoderModel, packed: PackedLinears | None) -> tuple[Layer, ...]:
    """Per-layer views and callables; ``packed`` entries replace the dense ones they cover."""

    none: tuple[Linear | None, ...] = (None,) * model.config.num_layers
    qkv, o, gate_up, down = (
        (none,) * 4 if packed is None else (packed.qkv, packed.o, packed.gate_up, packed.down)
    )

    def pick(weight: torch.Tensor, small: Linear | None) -> Linear:
        return dense(weight, model.dtype) if small is None else small

    c = model.config
    eps = c.rms_norm_eps
    # RoPE runs in the qkv call only where nothing comes between the projection and it
    plain_qk = (
        Rope(c.num_heads + c.num_kv_heads, c.head_dim)
        if model.qkv_bias is None
        and model.qk_norm is None
        and not c.layer_rope_thetas  # the fused call knows one RoPE table
        and model.rope.dtype == torch.float32
        else None
    )

    def bias(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
        return None if t is None else t[i]

    def experts(weights: torch.Tensor | None, packs: tuple[Experts | None, ...], i: int) -> Experts:
        small = packs[i] if packs else None
        if small is not None:
            return small
        # dense experts as moe_mlp runs them (F.linear, no prepacked copy of every expert)
        return (
            ()
            if weights is None
            else tuple(functools.partial(F.linear, weight=w) for w in weights[i])
        )

    egu, edown = ((), ()) if packed is None else (packed.experts_gate_up, packed.experts_down)

    # The one-call block runs o to the down projection's residual add with nothing between:
    # a bias on any of them is added between those steps, so the block is off.
    block = model.o_bias is None and model.gate_up_bias is None
    return tuple(
        Layer(
            attn_norm=model.attn_norm[i],
            qkv=pick(model.qkv[i], qkv[i]),
            qkv_bias=None if model.qkv_bias is None else model.qkv_bias[i],
            qk_norm=None if model.qk_norm is None else model.qk_norm[i],
            o=pick(model.o[i], o[i]),
            mlp_norm=model.mlp_norm[i],
            gate_up=pick(model.gate_up[i], gate_up[i]),
            down=pick(model.down[i], down[i]),
            normed_qkv=normed(qkv[i], model.attn_norm[i], eps),
            roped_qkv=None
            if plain_qk is None
            else _roped(qkv[i], model.attn_norm[i], eps, plain_qk),
            o_into=_into(o[i]),
            normed_gate_up=normed(gate_up[i], model.mlp_norm[i], eps),
            gated_down_into=_gated_into(down[i]),
            mlp_into=_mlp(o[i], model.mlp_norm[i], eps, gate_up[i], down[i]) if block else None,
            o_bias=bias(model.o_bias, i),
            gate_up_bias=bias(model.gate_up_bias, i),
            down_bias=bias(model.down_bias, i),
            experts_gate_up=experts(model.experts_gate_up, egu, i),
            experts_down=experts(model.experts_down, edown, i),
        )
        for i in range(model.config.num_layers)
    )


def normed(lin: Linear | None, gamma: torch.Tensor, eps: float) -> Linear | None:
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


def stack(model: DecoderModel, packed: PackedLinears | None) -> DecoderStack | None:
    """Every layer as one native call (:class:`DecoderStack`), where each layer's qkv, o,
    gate/up and down (or each of its experts' gate/up and down) are the fusing packed GEMV:
    every family's layer (biases, q/k norms, sandwich norms, GeGLU, a RoPE base per layer,
    experts with their float32 router, windows and softcaps through kvcache's attention)."""
    c = model.config
    if (
        packed is None
        or model.rope.dtype != torch.float32
        or model.attn_norm.dtype != torch.float32
    ):
        return None
    if c.activation not in STACK_GATES:
        log.debug("native_stack_off", arch=c.arch, because="an unknown gate")
        return None

    def row(t: torch.Tensor | None, *at: int) -> torch.Tensor | None:
        return None if t is None else t[at].detach()

    post = model.post_norms
    layers = []
    for i in range(c.num_layers):
        qkv, o = packed.qkv[i], packed.o[i]
        experts = _stack_experts(model, packed, i)
        gate_up, down = packed.gate_up[i], packed.down[i]
        if not (
            isinstance(qkv, Q4Linear)
            and isinstance(o, Q4Linear)
            and qkv.fuses
            and o.fuses
            and (
                experts is not None
                or (
                    isinstance(gate_up, Q4Linear)
                    and isinstance(down, Q4Linear)
                    and gate_up.fuses
                    and down.fuses
                )
            )
        ):
            log.debug("native_stack_off", arch=c.arch, because="a projection off the 4-bit GEMV")
            return None
        layers.append(
            StackLayer(
                model.attn_norm[i].detach(),
                qkv,
                o,
                model.mlp_norm[i].detach(),
                gate_up if experts is None and isinstance(gate_up, Q4Linear) else None,
                down if experts is None and isinstance(down, Q4Linear) else None,
                qkv_bias=row(model.qkv_bias, i),
                qk_norm=row(model.qk_norm, i),
                rope_table=model.layer_rope_table(i),
                o_bias=row(model.o_bias, i),
                gate_up_bias=row(model.gate_up_bias, i),
                down_bias=row(model.down_bias, i),
                post_attn_norm=row(post, i, 0),
                post_mlp_norm=row(post, i, 1),
                experts=experts,
            )
        )
    return DecoderStack(
        layers,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.rms_norm_eps,
        c.activation,
        c.query_scale,
    )


def _stack_experts(model: DecoderModel, packed: PackedLinears, i: int) -> StackExperts | None:
    """Layer ``i``'s experts for the native stack: its float32 router and every expert's
    packs on the fusing 4-bit GEMV; None where the layer has no experts or they are not so
    packed."""
    routing, router = model.routing, model.router
    if routing is None or router is None or not packed.experts_gate_up:
        return None
    gate_up, down = packed.experts_gate_up[i], packed.experts_down[i]
    if (
        gate_up is None
        or down is None
        or router.dtype != torch.float32
        or not all(isinstance(lin, Q4Linear) and lin.fuses for lin in (*gate_up, *down))
    ):
        return None
    return StackExperts(
        router[i].detach().contiguous(),
        tuple(lin for lin in gate_up if isinstance(lin, Q4Linear)),
        tuple(lin for lin in down if isinstance(lin, Q4Linear)),
        routing.top_k,
        routing.normalize_top_k,
    )
