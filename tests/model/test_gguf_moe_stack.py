"""GGUF mixture-of-experts checkpoints (Mixtral as ``llama``, Qwen3-MoE as ``qwen3moe``, each
expert projection stacked into one ``ffn_*_exps`` tensor) decode through the native decoder
stack under the default flags, with every expert packed from the file's own blocks in its
own format: the packs read back exactly what gguf-py dequantizes, the greedy tokens are the
layer loop's, and a request's tokens are the same bits alone and beside others."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from service.model import load_model
from service.model.gguf_loader import read_gguf
from service.model.native import kernels
from service.model.quant import Int4Codes, KBlocks
from tests.fixtures import tiny_families as tf
from tests.fixtures.tiny_gguf import write_gguf_from_hf
from tests.model.test_family_stack import _decode
from tests.model.test_native_gemv import _greedy_alone

LAYERS = 2
PROJECTIONS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Each case: the HF checkpoint, then each expert projection's block type (attention and the
# head in Q8_0). K-quants take inputs of whole 256s: that case is 256 wide, its experts
# random K-quant blocks (gguf-py quantizes none) as llama.cpp's Q4_K_M mixes them.
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Q]]] = {
    "mixtral-q4_0-q8_0": (
        "mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, seed=25),
        {"ffn_gate_exps": Q.Q4_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0},
    ),
    "mixtral-q4_1-q5_0": (
        "mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, seed=27),
        {"ffn_gate_exps": Q.Q4_1, "ffn_up_exps": Q.Q4_1, "ffn_down_exps": Q.Q5_0},
    ),
    "qwen3_moe-q8_0-q4_0": (
        "qwen3_moe",
        dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            norm_topk_prob=True, head_dim=16, seed=26,
        ),
        {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q4_0},
    ),
    "qwen3_moe-q4_k-q6_k": (
        "qwen3_moe",
        dict(
            num_experts=4, num_experts_per_tok=2, hidden_size=256, moe_intermediate_size=256,
            norm_topk_prob=True, head_dim=16, seed=28,
        ),
        {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K, "ffn_down_exps": Q.Q6_K},
    ),
}  # fmt: skip
_K_QUANTS = (Q.Q4_K, Q.Q6_K)


def _k_blocks(kind: Q, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random, valid ggml K-quant blocks of ``kind`` for a ``[..., n, k]`` tensor, with
    scales that keep a tiny model's weights within about 0.1."""
    rng = np.random.default_rng(seed)
    *lead, k = shape
    blocks = int(np.prod(lead)) * k // 256

    def halves(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, (blocks, 1)).astype(np.float16).view(np.uint8)

    def raw(width: int) -> np.ndarray:
        return rng.integers(0, 256, (blocks, width)).astype(np.uint8)

    if kind == Q.Q4_K:  # d, dmin, 12 bytes of scales and minimums, 128 of q
        parts = [halves(2e-5, 1e-4), halves(2e-5, 1e-4), raw(12), raw(128)]
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high bits, 16 int8 scales, d
        parts = [raw(128), raw(64), raw(16), halves(1e-5, 5e-5)]
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)


def _write(case: str, directory: Path) -> Path:
    """The case's GGUF: attention and head in Q8_0, the experts in the case's types."""
    model_type, config, experts = CASES[case]
    hf = tf.write_tiny(directory, model_type, **config)
    quantized = {"output.weight": Q.Q8_0}
    blocks: dict[str, tuple[Q, np.ndarray]] = {}
    hidden = int(config.get("hidden_size", 64))
    inter = int(config.get("moe_intermediate_size", 128))
    count = int(config.get("num_local_experts") or config["num_experts"])
    for i in range(LAYERS):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            quantized[f"blk.{i}.{name}.weight"] = Q.Q8_0
        for name, kind in experts.items():
            if kind not in _K_QUANTS:
                quantized[f"blk.{i}.{name}.weight"] = kind
                continue
            rows, cols = (hidden, inter) if name == "ffn_down_exps" else (inter, hidden)
            data = _k_blocks(kind, (count, rows, cols), seed=10 * i + len(blocks))
            blocks[f"blk.{i}.{name}.weight"] = (kind, data)
    return write_gguf_from_hf(hf, directory / "m.gguf", quantized=quantized, blocks=blocks)


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    return request.param, _write(request.param, tmp_path / request.param)


def test_each_expert_is_packed_from_its_own_blocks(case: tuple[str, Path]) -> None:
    """Every expert's blocks are its slice of the stacked tensor, exactly (what gguf-py
    dequantizes), and the stack's pack of it reads those weights back through the kernel."""
    name, path = case
    experts = CASES[name][2]
    ckpt = read_gguf(path)
    lm = load_model(path, progress=False)
    stack = lm.model.stack
    assert isinstance(stack, kernels.DecoderStack)
    count = lm.model.config.num_experts
    for i, layer in enumerate(stack.layers):
        assert layer.experts is not None and layer.gate_up is None and layer.down is None
        assert len(layer.experts.gate_up) == count
        for e in range(count):
            want = {}
            for gguf_name, kind in experts.items():
                raw = ckpt.tensors[f"model.layers.{i}.mlp.experts.{PROJECTIONS[gguf_name]}.weight"]
                assert raw.tensor_type == kind
                hf = f"model.layers.{i}.mlp.experts.{e}.{PROJECTIONS[gguf_name]}.weight"
                n, k = (int(d) for d in reversed(raw.shape[:2].tolist()))
                reference = dequantize(raw.data[e], kind).reshape(n, k)
                blocks = ckpt.file_blocks(hf)
                if kind in _K_QUANTS:
                    assert isinstance(blocks, KBlocks)
                    got = blocks.exact().float()
                else:
                    assert isinstance(blocks, Int4Codes)
                    got = blocks.dequantize()
                assert torch.equal(got, torch.from_numpy(reference.astype(np.float32)))
                assert torch.equal(got, ckpt.get(hf))
                want[gguf_name] = got
            gate_up = torch.cat([want["ffn_gate_exps"], want["ffn_up_exps"]])
            down = want["ffn_down_exps"]
            for lin, w in ((layer.experts.gate_up[e], gate_up), (layer.experts.down[e], down)):
                back = lin(torch.eye(w.shape[1])).T.double()
                assert (back - w.double()).abs().max().item() <= 1e-6 * w.abs().max().item()


def _tokens(got: list[list[tuple[int, float]]]) -> list[list[int]]:
    return [[t for t, _ in g] for g in got]


def _decode_both(lm: Any) -> tuple[list[Any], list[Any]]:
    """:func:`_decode` through the model's stack, then through the layer loop."""
    stack = lm.model.stack
    native = _decode(lm, stack)
    try:
        loop = _decode(lm, None)
    finally:
        lm.model.use_stack(stack)
    return native, loop


def test_default_flags_decode_through_the_stack_as_the_layer_loop(case: tuple[str, Path]) -> None:
    """Under the default flags every layer, experts included, runs in the native stack and
    gives the layer loop's greedy tokens; with every projection on the 4-bit GEMV the model
    runs batch-invariant: a request's tokens and logprobs are the same bits alone as beside
    two others. In float32 (the dense weights too) the logprobs match the loop's within
    float32 rounding."""
    _, path = case
    lm = load_model(path, progress=False)
    stack = lm.model.stack
    assert isinstance(stack, kernels.DecoderStack)
    assert all(layer.experts is not None for layer in stack.layers)
    assert lm.batch_invariant
    native, loop = _decode_both(lm)
    assert [len(g) for g in native] == [10, 8, 6]
    assert _tokens(native) == _tokens(loop)
    assert _greedy_alone(lm, 1, 5, 5, 8) == native[1]
    lm = load_model(path, dtype="float32", progress=False)
    assert isinstance(lm.model.stack, kernels.DecoderStack)
    native, loop = _decode_both(lm)
    assert _tokens(native) == _tokens(loop)
    for g, w in zip(native, loop, strict=True):
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w, strict=True)) < 1e-3
