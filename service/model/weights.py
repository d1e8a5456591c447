"""Turn a checkpoint's per-tensor weights (HF names) into the fused, stacked layout
:class:`~service.model.decoder.DecoderModel` runs on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from service.model.decoder import DecoderWeights
from service.model.load_error import ModelLoadError
from service.model.model_config import ModelConfig
from service.model.packed import CodesGetter, build_packed
from service.model.progress import Progress

# name -> tensor; raises ModelLoadError when the checkpoint lacks it.
TensorGetter = Callable[[str], torch.Tensor]


def tensor_names(config: ModelConfig) -> list[str]:
    """Every HF-style tensor name the model needs, in load order."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
        if config.attention_bias:
            names += [f"{p}self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")]
        if config.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config.sandwich_norms:
            names += [p + "attn_out_norm.weight", p + "mlp_out_norm.weight"]
        if config.num_experts:
            names.append(p + "mlp.gate.weight")
            names += [
                f"{p}mlp.experts.{e}.{proj}.weight"
                for e in range(config.num_experts)
                for proj in ("gate_proj", "up_proj", "down_proj")
            ]
            continue
        names += [f"{p}mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
        if config.mlp_bias:
            names += [f"{p}mlp.{proj}.bias" for proj in ("gate_proj", "up_proj", "down_proj")]
    return names


class _Stacker:
    """Copies per-layer tensors into one preallocated [L, ...] tensor, checking shapes."""

    def __init__(
        self, get: TensorGetter, dtype: torch.dtype, device: str, progress: Progress
    ) -> None:
        self._get = get
        self._dtype = dtype
        self._device = device
        self._progress = progress

    def one(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self._get(name)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        self._progress.advance()
        return t.to(device=self._device, dtype=self._dtype)

    def stacked(self, layers: int, parts: list[tuple[str, tuple[int, ...]]]) -> torch.Tensor:
        """``parts``: name templates with ``{i}`` and the shape of each; concatenated on dim 0."""
        rows = sum(shape[0] for _, shape in parts)
        out = torch.empty((layers, rows, *parts[0][1][1:]), dtype=self._dtype, device=self._device)
        for i in range(layers):
            start = 0
            for template, shape in parts:
                out[i, start : start + shape[0]] = self.one(template.format(i=i), shape)
                start += shape[0]
        return out


def build_weights(
    config: ModelConfig,
    get: TensorGetter,
    dtype: torch.dtype,
    device: str,
    progress: Progress,
    *,
    weights: str = "bf16",
    codes: CodesGetter | None = None,
    dense_dtype: torch.dtype | None = None,
) -> DecoderWeights:
    """Dense stacked weights, plus packed copies for ``weights`` (a resolved mode, see
    :func:`service.model.packed.resolve_weights`); ``codes`` reads the file's own blocks.
    With ``dense_dtype`` the dense projections (and an untied output head) are stored in it
    once the packs are built from them; the embeddings and norms stay in ``dtype``."""
    dense = _build_dense(config, get, dtype, device, progress)
    if weights != "bf16":
        by_name = {
            "qkv": dense.qkv,
            "o": dense.o,
            "gate_up": dense.gate_up,
            "down": dense.down,
            "experts_gate_up": dense.experts_gate_up,
            "experts_down": dense.experts_down,
        }

        def fused(name: str) -> torch.Tensor:
            if name == "lm_head":
                return dense.embed if dense.lm_head is None else dense.lm_head
            kind, *at = name.split(".")  # the layer, then (experts) the expert
            stacked = by_name[kind]
            assert stacked is not None, name
            return stacked[tuple(int(i) for i in at)]

        packed = build_packed(
            config, weights, codes or (lambda name: None), fused, dtype, dense_dtype or dtype
        )
        dense = dataclasses.replace(dense, packed=packed)
    if dense_dtype is None or dense_dtype == dtype:
        return dense
    return dataclasses.replace(
        dense,
        qkv=dense.qkv.to(dense_dtype),
        o=dense.o.to(dense_dtype),
        gate_up=dense.gate_up.to(dense_dtype),
        down=dense.down.to(dense_dtype),
        lm_head=None if dense.lm_head is None else dense.lm_head.to(dense_dtype),
    )


def _build_dense(
    config: ModelConfig, get: TensorGetter, dtype: torch.dtype, device: str, progress: Progress
) -> DecoderWeights:
    c = config
    s = _Stacker(get, dtype, device, progress)
    h, q, kv, d, n = c.hidden_size, c.q_size, c.kv_size, c.head_dim, c.num_layers
    attn = "model.layers.{i}.self_attn."
    mlp = "model.layers.{i}.mlp."
    embed = s.one("model.embed_tokens.weight", (c.vocab_size, h))
    lm_head = None if c.tie_word_embeddings else s.one("lm_head.weight", (c.vocab_size, h))
    final_norm = s.one("model.norm.weight", (h,))
    attn_norm = s.stacked(n, [("model.layers.{i}.input_layernorm.weight", (h,))])
    qkv = s.stacked(
        n,
        [
            (attn + "q_proj.weight", (q, h)),
            (attn + "k_proj.weight", (kv, h)),
            (attn + "v_proj.weight", (kv, h)),
        ],
    )
    qkv_bias = None
    if c.attention_bias:
        qkv_bias = s.stacked(
            n,
            [
                (attn + "q_proj.bias", (q,)),
                (attn + "k_proj.bias", (kv,)),
                (attn + "v_proj.bias", (kv,)),
            ],
        )
    qk_norm = None
    if c.qk_norm:
        norms = s.stacked(n, [(attn + "q_norm.weight", (d,)), (attn + "k_norm.weight", (d,))]).view(
            n, 2, d
        )
        # One weight row per head so q and k heads are normalized in a single op.
        qk_norm = torch.cat(
            [norms[:, 0:1].expand(n, c.num_heads, d), norms[:, 1:2].expand(n, c.num_kv_heads, d)],
            dim=1,
        ).contiguous()
    o = s.stacked(n, [(attn + "o_proj.weight", (h, q))])
    mlp_norm = s.stacked(n, [("model.layers.{i}.post_attention_layernorm.weight", (h,))])
    inter = c.intermediate_size
    experts = _experts(c, s) if c.num_experts else None
    if experts is None:
        gate_up = s.stacked(
            n, [(mlp + "gate_proj.weight", (inter, h)), (mlp + "up_proj.weight", (inter, h))]
        )
        down = s.stacked(n, [(mlp + "down_proj.weight", (h, inter))])
    else:  # no dense MLP: every layer's MLP is its experts
        gate_up = torch.empty((n, 0, h), dtype=dtype, device=device)
        down = torch.empty((n, h, 0), dtype=dtype, device=device)
    post = None
    if c.sandwich_norms:
        post = s.stacked(
            n,
            [
                ("model.layers.{i}.attn_out_norm.weight", (h,)),
                ("model.layers.{i}.mlp_out_norm.weight", (h,)),
            ],
        ).view(n, 2, h)
    o_bias = s.stacked(n, [(attn + "o_proj.bias", (h,))]) if c.o_bias else None
    gate_up_bias = down_bias = None
    if c.mlp_bias:
        gate_up_bias = s.stacked(
            n, [(mlp + "gate_proj.bias", (inter,)), (mlp + "up_proj.bias", (inter,))]
        )
        down_bias = s.stacked(n, [(mlp + "down_proj.bias", (h,))])
    if c.norm_offset:
        # (1 + w) norms: the offset is added once here, in the compute dtype, as the
        # reference adds it on every call.
        for norm in (final_norm, attn_norm, mlp_norm, qk_norm, post):
            if norm is not None:
                norm.add_(c.norm_offset)
    return DecoderWeights(
        embed=embed,
        lm_head=lm_head,
        final_norm=final_norm,
        attn_norm=attn_norm.view(n, h),
        qkv=qkv,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        o=o,
        mlp_norm=mlp_norm.view(n, h),
        gate_up=gate_up,
        down=down,
        o_bias=o_bias,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        post_norms=post,
        router=None if experts is None else experts[0],
        experts_gate_up=None if experts is None else experts[1],
        experts_down=None if experts is None else experts[2],
    )


def _experts(c: ModelConfig, s: _Stacker) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router [L, E, H], gate_up [L, E, 2I, H], down [L, E, H, I])``."""
    n, h, inter, e = c.num_layers, c.hidden_size, c.intermediate_size, c.num_experts
    mlp = "model.layers.{i}.mlp."
    router = s.stacked(n, [(mlp + "gate.weight", (e, h))])
    gate_up = s.stacked(
        n,
        [
            (mlp + f"experts.{j}.{proj}.weight", (inter, h))
            for j in range(e)
            for proj in ("gate_proj", "up_proj")
        ],
    ).view(n, e, 2 * inter, h)
    down = s.stacked(
        n, [(mlp + f"experts.{j}.down_proj.weight", (h, inter)) for j in range(e)]
    ).view(n, e, h, inter)
    return router, gate_up, down
