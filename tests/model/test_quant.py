"""Packed int4/int8 weights: the GGUF block mappings are exact, and the model dispatches
decode-sized batches to them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvcache.dense import DenseAttention
from service.model import load_model
from service.model.gguf_loader import read_gguf
from service.model.native import kernels
from service.model.packed import resolve_weights
from service.model.quant import (
    Int4Linear,
    Int8Linear,
    from_q4_0,
    from_q4_1,
    from_q5_0,
    from_q8_0,
    quantize_int4,
)

N, K = 48, 96  # 3 blocks of 32 per row


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _blocks(kind: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random, valid ggml blocks of ``kind`` for an [N, K] tensor, as GGUFReader yields them."""
    g = K // 32
    d = _f16_bytes(rng.uniform(0.001, 0.05, (N, g)))
    if kind == GGMLQuantizationType.Q8_0:
        qs = rng.integers(-128, 128, (N, g, 32)).astype(np.int8).view(np.uint8)
        return np.concatenate([d, qs], axis=-1).reshape(N, -1)
    qs = rng.integers(0, 256, (N, g, 16)).astype(np.uint8)
    if kind == GGMLQuantizationType.Q5_0:
        qh = rng.integers(0, 256, (N, g, 4)).astype(np.uint8)
        return np.concatenate([d, qh, qs], axis=-1).reshape(N, -1)
    if kind == GGMLQuantizationType.Q4_0:
        return np.concatenate([d, qs], axis=-1).reshape(N, -1)
    m = _f16_bytes(rng.uniform(-0.3, 0.1, (N, g)))
    return np.concatenate([d, m, qs], axis=-1).reshape(N, -1)


UNPACK = {
    GGMLQuantizationType.Q4_0: from_q4_0,
    GGMLQuantizationType.Q4_1: from_q4_1,
    GGMLQuantizationType.Q8_0: from_q8_0,
    GGMLQuantizationType.Q5_0: from_q5_0,
}


@pytest.mark.parametrize("kind", list(UNPACK), ids=lambda k: k.name)
def test_packed_kernel_reproduces_gguf_dequantization_exactly(kind: GGMLQuantizationType) -> None:
    data = _blocks(kind, np.random.default_rng(int(kind)))
    reference = torch.from_numpy(dequantize(data, kind).reshape(N, K).astype(np.float32))
    codes = UNPACK[kind](data, N)
    assert torch.equal(codes.dequantize(), reference)
    # Multiplying the identity through the kernel reads every weight back out: fp32 scales
    # and zeros keep the file's fp16 values, so any slip in nibble order, the zero point
    # (m + 8d) or the Q8_0 split shows as a non-zero difference.
    kernel = Int4Linear.pack(codes, torch.float32)
    weights_back = kernel(torch.eye(K)).T
    assert torch.equal(weights_back, reference)


def test_bf16_packs_differ_from_the_file_only_by_bf16_rounding() -> None:
    kind = GGMLQuantizationType.Q4_1
    data = _blocks(kind, np.random.default_rng(7))
    reference = torch.from_numpy(dequantize(data, kind).reshape(N, K).astype(np.float32))
    back = Int4Linear.pack(from_q4_1(data, N), torch.bfloat16)(torch.eye(K, dtype=torch.bfloat16))
    err = (back.T.float() - reference).abs()
    # scale, zero and the output each round to bf16 (relative 2^-9): a few units of 2^-8 of
    # the block's range at most.
    assert 0 < err.max().item() <= 2**-6 * reference.abs().max().item()


def test_int4_and_int8_quantization_of_dense_weights_are_close() -> None:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4))
    exact = x @ w.T
    int4 = Int4Linear.pack(quantize_int4(w), torch.float32)(x)
    int8 = Int8Linear.quantize(w, torch.float32)(x)
    scale = exact.abs().max().item()
    assert (int4 - exact).abs().max().item() < 0.1 * scale
    assert (int8 - exact).abs().max().item() < 0.02 * scale


def test_default_model_codes_match_its_dequantized_tensors(default_model_path: Path) -> None:
    ckpt = read_gguf(default_model_path)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, rows un-permuted like the dense path
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
    ):
        codes = ckpt.file_blocks(name)
        assert codes is not None
        assert torch.equal(codes.dequantize(), ckpt.get(name))
    embed = ckpt.file_blocks("model.embed_tokens.weight")  # Q8_0: the tied output projection
    assert embed is not None and embed.repeat == 2
    rows = torch.arange(0, 49152, 97)
    assert torch.equal(embed.rows(rows).dequantize(), ckpt.get("model.embed_tokens.weight")[rows])
    assert ckpt.file_blocks("model.layers.0.input_layernorm.weight") is None  # F32: no blocks


def test_auto_resolves_to_the_files_blocks_only_where_a_fast_kernel_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert resolve_weights("auto", torch.bfloat16, "cpu") == "file"
    # float32: kvfence's own GEMV (built with the system compiler, as in CI), else dense
    assert kernels.kernel() is not None
    assert resolve_weights("auto", torch.float32, "cpu") == "file"
    monkeypatch.setenv("KVFENCE_CPU_KERNEL", "off")
    assert resolve_weights("auto", torch.float32, "cpu") == "bf16"
    monkeypatch.delenv("KVFENCE_CPU_KERNEL")
    assert resolve_weights("auto", torch.bfloat16, "cuda") == "bf16"
    assert resolve_weights("int4", torch.float32, "cpu") == "int4"
    with pytest.raises(ValueError, match="int8"):
        resolve_weights("int8", torch.bfloat16, "cuda:0")
    with pytest.raises(ValueError, match="unknown weights mode"):
        resolve_weights("int3", torch.bfloat16, "cpu")


@pytest.mark.slow
def test_model_uses_packs_for_small_batches_and_dense_for_large(default_model_path: Path) -> None:
    # int8 per-row quantization is lossy, so its logits visibly differ from the dense ones:
    # a decode-sized batch must show the difference, a prefill-sized one must not.
    dense = load_model(default_model_path, dtype="float32", weights="bf16", progress=False)
    int8 = load_model(default_model_path, dtype="float32", weights="int8", progress=False)
    assert int8.weights == "int8" and int8.model.packed is not None
    assert dense.model.packed is None
    ids = torch.tensor([1, 4093, 30, 2260, 314, 253, 1345, 28, 338, 1429])
    big = len(ids)
    small = int8.model.packed.max_rows
    assert big > small

    def logits(m: torch.nn.Module, n: int) -> torch.Tensor:
        out: torch.Tensor = m(ids[:n], torch.arange(n), DenseAttention(30))
        return out

    assert torch.equal(logits(int8.model, big), logits(dense.model, big))
    diff = (logits(int8.model, small) - logits(dense.model, small)).abs().max().item()
    assert diff > 1e-3
