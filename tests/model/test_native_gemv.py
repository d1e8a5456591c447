"""The float32 4-bit GEMV (service/model/native/kvf.c): built from source on first use, it
computes ``x @ w.T`` from GGUF blocks as a float32 matmul on the dequantized weights does,
and ``--weights auto`` uses it in float32 where it builds."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvcache import native_build
from kvcache.attention import NativeAttend
from kvcache.backends import cpu_decode
from kvcache.dense import DenseAttention
from kvcache.errors import KernelRefused
from service.model import ModelLoadError, load_model
from service.model.loader import resolve_precision
from service.model.native import kernels
from service.model.quant import (
    Int4Codes,
    Int4Linear,
    KBlocks,
    from_q4_0,
    from_q4_1,
    from_q4_k,
    from_q5_0,
    from_q6_k,
    from_q8_0,
    quantize_int4,
)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVFENCE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", {})
    yield


def _kernel() -> kernels.Q4Kernel:
    kernel = kernels.kernel()
    assert kernel is not None, "a C compiler is here: the kernel must build"
    return kernel


def _portable(tmp_path: Path) -> kernels.Q4Kernel:
    """The plain C loops (no AVX2), as a CPU without them runs."""
    target = tmp_path / "portable.so"
    native_build.compile_library(str(shutil.which("cc")), kernels.SOURCE, target, "x86-64")
    kernel = kernels.Q4Kernel(ctypes.CDLL(str(target)))
    assert not kernel.simd
    return kernel


def _ggml(kind: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = k // 32
    d = rng.uniform(0.001, 0.05, (n, g)).astype(np.float16)[..., None].view(np.uint8)
    if kind == GGMLQuantizationType.Q8_0:
        qs = rng.integers(-128, 128, (n, g, 32)).astype(np.int8).view(np.uint8)
        return np.concatenate([d, qs], axis=-1).reshape(n, -1)
    qs = rng.integers(0, 256, (n, g, 16)).astype(np.uint8)
    if kind == GGMLQuantizationType.Q5_0:
        qh = rng.integers(0, 256, (n, g, 4)).astype(np.uint8)
        return np.concatenate([d, qh, qs], axis=-1).reshape(n, -1)
    if kind == GGMLQuantizationType.Q4_0:
        return np.concatenate([d, qs], axis=-1).reshape(n, -1)
    m = rng.uniform(-0.3, 0.1, (n, g)).astype(np.float16)[..., None].view(np.uint8)
    return np.concatenate([d, m, qs], axis=-1).reshape(n, -1)


UNPACK = {
    GGMLQuantizationType.Q4_0: from_q4_0,
    GGMLQuantizationType.Q4_1: from_q4_1,
    GGMLQuantizationType.Q8_0: from_q8_0,
    GGMLQuantizationType.Q5_0: from_q5_0,
}


def _bound(x: torch.Tensor, codes: Int4Codes, reference: torch.Tensor) -> torch.Tensor:
    """The kernel's stated error per output: x rounded to int16 per block of 32 (at most half
    a step, max|x| / 32767, per element) times the block's sum of |d * q|, plus float32
    rounding of a few ulps of the row's magnitude. ``[M, N]``."""
    n = reference.shape[0]
    xb = x.abs().double().view(x.shape[0], -1, 32)
    half_step = xb.amax(dim=-1) / 32767 / 2  # [M, G]
    q = codes.codes.double().view(n, -1, 32)
    dq = (codes.scale.double()[..., None] * q).abs().sum(dim=-1)  # [N, G * repeat]
    if codes.repeat > 1:  # both halves read the same x block
        dq = dq.view(n, codes.repeat, -1).sum(dim=1)
    rounding = half_step @ dq.T
    return rounding + 1e-5 * (x.abs().double() @ reference.abs().double().T)


def _check(kernel: kernels.Q4Kernel, codes: Int4Codes, reference: torch.Tensor) -> None:
    lin = kernels.Q4Linear.pack(codes, kernel)
    n, k = reference.shape
    # The identity reads every weight back out: any slip in the nibble order, the minimum
    # (zero - 8 * scale) or the Q8_0 split shows far above the rounding of the step.
    for start in range(0, k, kernel.max_rows):
        rows = min(kernel.max_rows, k - start)
        eye = torch.eye(k)[start : start + rows]
        want = reference[:, start : start + rows].T
        assert (lin(eye) - want).abs().max().item() <= 1e-6 * reference.abs().max().item()
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(n + k))
    exact = x.double() @ reference.double().T
    bound = _bound(x, codes, reference)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
    for m in (1, 2, 3, 4, 5, 8, 9):  # batches of 4 rows share the weights' unpacking (tiles)
        got = lin(x[:m])
        assert ((got.double() - exact[:m]).abs() <= bound[:m]).all()
        assert torch.equal(got, alone[:m])  # a row's result does not depend on its batch


@pytest.mark.parametrize("kind", list(UNPACK), ids=lambda k: k.name)
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_kernel_reproduces_the_files_weights(
    kind: GGMLQuantizationType, portable: bool, tmp_path: Path
) -> None:
    n, k = 37, 96  # an odd number of output rows, 3 blocks a row
    data = _ggml(kind, n, k, int(kind))
    reference = torch.from_numpy(dequantize(data, kind).reshape(n, k).astype(np.float32))
    kernel = _portable(tmp_path) if portable else _kernel()
    _check(kernel, UNPACK[kind](data, n), reference)


def _exact_weights(kind: GGMLQuantizationType, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    """The blocks' weights in float64, each exactly ``d * q + m`` (``d * q`` for Q8_0)."""
    if kind == GGMLQuantizationType.Q5_0:  # d * (q - 16): exact in float32 already
        return torch.from_numpy(dequantize(data, kind).reshape(n, k).astype(np.float64))
    b = data.reshape(n, k // 32, -1)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float64)
    if kind == GGMLQuantizationType.Q8_0:
        w = d * b[..., 2:].copy().view(np.int8).astype(np.float64)
    else:
        qs = b[..., 2:] if kind == GGMLQuantizationType.Q4_0 else b[..., 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64)
        if kind == GGMLQuantizationType.Q4_0:
            m = -8 * d
        else:
            m = b[..., 2:4].copy().view(np.float16).astype(np.float64)
        w = d * q + m
    return torch.from_numpy(w.reshape(n, k))


@pytest.mark.parametrize("kind", list(UNPACK), ids=lambda k: k.name)
def test_tile_unit_batches_compute_the_dense_bf16_product(kind: GGMLQuantizationType) -> None:
    """Weights packed with ``tiles`` run batches of ``amx_min_rows`` or more rows on the tile
    unit (AMX-BF16 CPUs): the product of x and the weights each rounded to bf16 (the weight
    computed in float32 first, as the dense bf16 copy is), summed in float32. A row's result
    does not depend on the rest of its batch; smaller batches keep the integer path."""
    kernel = _kernel()
    if not kernel.amx:
        pytest.skip("this CPU has no AMX-BF16 tile unit")
    n, k = 37, 96  # 37 output rows: two whole 16-row panels and a partial one
    data = _ggml(kind, n, k, 40 + int(kind))
    codes = UNPACK[kind](data, n)
    tiled = kernels.Q4Linear.pack(codes, kernel, tiles=True)
    plain = kernels.Q4Linear.pack(codes, kernel)
    w = _exact_weights(kind, data, n, k).float().bfloat16().double()
    x = torch.randn(kernel.max_rows, k, generator=torch.Generator().manual_seed(7)) * 3
    xb = x.bfloat16().double()
    want = xb @ w.T
    bound = 1e-5 * (xb.abs() @ w.abs().T) + 1e-30
    full = tiled(x)
    assert ((full.double() - want).abs() <= bound).all()
    for m in (1, kernel.amx_min_rows - 1):
        assert torch.equal(tiled(x[:m]), plain(x[:m]))
    for m in (kernel.amx_min_rows, 16, 17, 40):  # partial and several 16-row tiles of x
        assert torch.equal(tiled(x[:m]), full[:m])
        assert not torch.equal(tiled(x[:m]), plain(x[:m]))
    # fused forms: the residual add, and the norm and the SiLU gate before the product
    residual = torch.randn(20, n, generator=torch.Generator().manual_seed(8))
    into = residual.clone()
    assert torch.equal(tiled.into(x[:20], into), residual + full[:20])
    gamma = torch.rand(k, generator=torch.Generator().manual_seed(9)) + 0.5
    normed = torch.nn.functional.rms_norm(x[:20], (k,), gamma, 1e-5)
    got = tiled.normed(x[:20], gamma, 1e-5)
    assert (got - tiled(normed)).abs().max().item() <= 1e-2 * got.abs().max().item()
    bad = x[:8].clone()
    bad[3, 5] = float("nan")
    out = tiled(bad)
    assert out[3].isnan().all() and out[[0, 1, 2, 4, 5, 6, 7]].isfinite().all()


def test_codes_quantized_from_dense_weights_take_fp16_scales() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    codes = quantize_int4(w)
    lin = kernels.Q4Linear.pack(codes, _kernel())
    back = lin(torch.eye(128)[:8]).T
    # scale and minimum round to fp16 (relative 2^-11): far inside int4's own error.
    want = codes.dequantize()[:, :8]
    assert (back - want).abs().max().item() <= 2**-9 * want.abs().max().item()
    assert (back - w[:, :8]).abs().max().item() < 0.2 * w.abs().max().item()


def test_kernel_refuses_what_it_does_not_take() -> None:
    kernel = _kernel()
    blocks = kernels.to_blocks(quantize_int4(torch.randn(8, 64)))
    with pytest.raises(ValueError, match="does not take"):
        kernel.matmul(torch.randn(1, 64, dtype=torch.bfloat16), blocks)
    with pytest.raises(ValueError, match="does not take"):
        kernel.matmul(torch.randn(kernel.max_rows + 1, 64), blocks)
    with pytest.raises(ValueError, match="does not take"):
        kernel.matmul(torch.randn(1, 96), blocks)  # K does not match the blocks


@pytest.mark.slow
def test_switched_off_or_no_compiler_keeps_torchs_kernel(
    monkeypatch: pytest.MonkeyPatch, default_model_path: Path
) -> None:
    assert isinstance(kernels.kernel(), kernels.Q4Kernel)
    monkeypatch.setenv("KVFENCE_CPU_KERNEL", "off")
    assert kernels.kernel() is None
    off = load_model(default_model_path, dtype="float32", weights="int4", progress=False)
    assert off.model.packed is not None
    assert isinstance(off.model.packed.lm_head, Int4Linear)  # torch's int4 kernel
    assert off.model.small_layers[0].normed_qkv is None  # nothing fused on that path
    monkeypatch.delenv("KVFENCE_CPU_KERNEL")
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert kernels.kernel() is None


@pytest.mark.slow
def test_float32_int4_decodes_through_the_kernel_like_the_dense_model(
    default_model_path: Path,
) -> None:
    dense = load_model(default_model_path, dtype="float32", weights="bf16", progress=False)
    auto = load_model(default_model_path, dtype="float32", weights="int4", progress=False)
    assert auto.weights == "int4" and auto.model.packed is not None
    assert isinstance(auto.model.packed.lm_head, kernels.Q4Linear)
    # the norms and the SiLU gate run inside the kernel calls on this path
    layer = auto.model.small_layers[0]
    assert layer.normed_qkv is not None and layer.normed_gate_up is not None
    assert layer.gated_down_into is not None and auto.model.normed_small_head is not None
    # ... and RoPE and the residual adds (the dense model does them in torch)
    assert layer.roped_qkv is not None and layer.o_into is not None
    assert isinstance(layer.mlp_into, kernels.MlpBlock)  # o to down in one call
    ids = torch.tensor([1, 4093, 30, 2260])
    n = len(ids)
    assert n <= auto.model.packed.max_rows

    def logits(m: torch.nn.Module) -> torch.Tensor:
        out: torch.Tensor = m(ids, torch.arange(n), DenseAttention(30))
        return out

    a, b = logits(auto.model), logits(dense.model)
    # Same weights (the file's, exactly), float32 both ways: only the summation order differs.
    assert (a - b).abs().max().item() < 1e-3 * b.abs().max().item()
    assert torch.equal(a.argmax(dim=-1), b.argmax(dim=-1))


def test_a_non_finite_input_never_gives_a_finite_output() -> None:
    """An inf in a row makes every output of that row non-finite (NaN where the row's block
    scale is inf, as the SIMD builds compute it; +-inf where the plain-C build multiplies it
    through, as float math does), and leaves the other rows as they were."""
    for kind in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        data = _ggml(kind, 8, 64, 3)
        lin = kernels.Q4Linear.pack(UNPACK[kind](data, 8), _kernel())
        x = torch.randn(2, 64)
        alone = lin(x[:1])
        x[1, 40] = float("inf")
        out = lin(x)
        assert torch.equal(out[0], alone[0]) and not out[1].isfinite().any()


def _k_quant(kind: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """Random, valid ggml K-quant blocks of ``kind`` for an [n, k] tensor (k of 256s)."""
    rng = np.random.default_rng(seed)
    blocks = n * k // 256

    def halves(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, (blocks, 1)).astype(np.float16).view(np.uint8)

    def raw(width: int) -> np.ndarray:
        return rng.integers(0, 256, (blocks, width)).astype(np.uint8)

    if kind == GGMLQuantizationType.Q4_K:  # d, dmin, 12 bytes of scales and minimums, 128 of q
        parts = [halves(0.0005, 0.004), halves(0.0005, 0.004), raw(12), raw(128)]
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high bits, 16 int8 scales, d
        parts = [raw(128), raw(64), raw(16), halves(0.0002, 0.002)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


K_UNPACK = {GGMLQuantizationType.Q4_K: from_q4_k, GGMLQuantizationType.Q6_K: from_q6_k}


def _k_bound(x: torch.Tensor, blocks: KBlocks, reference: torch.Tensor) -> torch.Tensor:
    """:func:`_bound` for K-quant blocks: x's int16 rounding per block of 32 times the
    block's sum of |scale * q| (the minimums multiply exact x sums), plus float32 rounding."""
    n, k = blocks.codes.shape
    xb = x.abs().double().view(x.shape[0], -1, 32)
    half_step = xb.amax(dim=-1) / 32767 / 2
    scaled = blocks.codes.double().view(n, -1, blocks.sub) * blocks.scale.double()[..., None]
    dq = scaled.abs().view(n, k // 32, 32).sum(dim=-1)
    return half_step @ dq.T + 1e-5 * (x.abs().double() @ reference.abs().double().T)


@pytest.mark.parametrize("kind", list(K_UNPACK), ids=lambda k: k.name)
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_kernel_reproduces_the_files_k_quant_weights(
    kind: GGMLQuantizationType, portable: bool, tmp_path: Path
) -> None:
    """Q4_K and Q6_K are served from their own codes with float32 sub-block scales (the
    wide layouts): the codes and scales are the file's exactly, the identity reads every
    weight back, a product stays within the input's int16 rounding, and a row's result does
    not depend on its batch."""
    n, k = 37, 512
    data = _k_quant(kind, n, k, int(kind))
    blocks = K_UNPACK[kind](data, n)
    reference = torch.from_numpy(dequantize(data, kind).reshape(n, k).astype(np.float32))
    assert torch.equal(blocks.exact().float(), reference)
    kernel = _portable(tmp_path) if portable else _kernel()
    lin = kernels.Q4Linear.pack_k(blocks, kernel)
    assert lin.wide and lin.q8 == (kind == GGMLQuantizationType.Q6_K)
    assert lin.in_panels() is lin and not lin.tiles
    assert lin.blocks.shape == (n, kernels.row_bytes(k, lin.q8, wide=True))
    exact = blocks.exact()
    for start in range(0, k, 128):
        eye = torch.eye(k)[start : start + 128]
        want = exact[:, start : start + 128].T
        assert (lin(eye).double() - want).abs().max().item() <= 1e-6 * exact.abs().max().item()
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
    bound = _k_bound(x, blocks, reference)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
    for m in (1, 2, 4, 5, 9):
        got = lin(x[:m])
        assert ((got.double() - x[:m].double() @ exact.T).abs() <= bound[:m]).all()
        assert torch.equal(got, alone[:m])
    # the fused norm and gate read the same weights
    gamma = torch.rand(k) + 0.5
    normed = torch.nn.functional.rms_norm(x, (k,), gamma, 1e-5)
    # (the kernel's norm and torch's round the normed input apart by float32 ulps)
    off = (lin.normed(x, gamma, 1e-5).double() - normed.double() @ exact.T).abs()
    assert (off <= 2 * _k_bound(normed, blocks, reference)).all()


def test_q8_0_codes_are_read_as_int8_blocks() -> None:
    n, k = 21, 64
    data = _ggml(GGMLQuantizationType.Q8_0, n, k, 11)
    lin = kernels.Q4Linear.pack(from_q8_0(data, n), _kernel())
    assert lin.q8 and lin.repeat == 1
    assert lin.blocks.shape == (n, kernels.row_bytes(k, q8=True))
    assert lin.nbytes == n * (k + 2 * 8)  # int8 codes, then 2 scales padded to 8 fp16
    # other two-half codes are not Q8_0: they keep the 4-bit path
    other = from_q8_0(data, n)
    other = Int4Codes(other.codes, other.scale * 1.5, other.zero, other.repeat)
    assert kernels.q8_blocks(other) is None


def test_q5_0_codes_are_read_as_int8_blocks() -> None:
    """Q5_0's ``q - 16`` is an int8 block: the 8-bit layout, not two 4-bit halves."""
    n, k = 21, 64
    lin = kernels.Q4Linear.pack(
        from_q5_0(_ggml(GGMLQuantizationType.Q5_0, n, k, 12), n), _kernel()
    )
    assert lin.q8 and lin.repeat == 1
    assert lin.nbytes == n * (k + 2 * 8)


def test_no_rows_give_no_rows() -> None:
    lin = kernels.Q4Linear.pack(quantize_int4(torch.randn(8, 64)), _kernel())
    assert lin(torch.empty(0, 64)).shape == (0, 8)


def test_fused_norm_and_gate_equal_the_torch_ops_then_the_kernel() -> None:
    kernel = _kernel()
    n, k = 40, 128
    data = _ggml(GGMLQuantizationType.Q4_1, n, k, 9)
    lin = kernels.Q4Linear.pack(from_q4_1(data, n), kernel)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, k, generator=gen) * 4
    gamma = torch.rand(k, generator=gen) + 0.5
    want = lin(torch.nn.functional.rms_norm(x, (k,), gamma, 1e-5))
    got = lin.normed(x, gamma, 1e-5)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    gate_up = torch.randn(3, 2 * k, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    want = lin(torch.nn.functional.silu(gate) * up)
    got = lin.gated(gate_up)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    with pytest.raises(ValueError, match="does not take"):
        lin.normed(x, gamma[:-1], 1e-5)
    with pytest.raises(ValueError, match="does not take"):
        lin.gated(x)  # [3, 128] gated is K = 64: not this weight's K


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_fused_gate_follows_torchs_silu_over_the_whole_float_range(
    portable: bool, tmp_path: Path
) -> None:
    """The SiLU gate inside the kernel call (a polynomial exp on AVX2, expf in plain C)
    follows ``F.silu(gate) * up`` from -120 to 120, where exp under- and overflows; a gate
    of +-inf or NaN makes its row NaN, as torch's silu then the kernel do."""
    kernel = _portable(tmp_path) if portable else _kernel()
    n, k = 24, 256
    lin = kernels.Q4Linear.pack(from_q4_1(_ggml(GGMLQuantizationType.Q4_1, n, k, 5), n), kernel)
    gate = torch.linspace(-120.0, 120.0, 4 * k).view(4, k)
    gate[1] = torch.linspace(-12.0, 12.0, k)  # where the curve bends
    up = torch.randn(4, k, generator=torch.Generator().manual_seed(3))
    want = lin(torch.nn.functional.silu(gate) * up)
    got = lin.gated(torch.cat([gate, up], dim=1))
    assert ((got - want).abs() <= 1e-4 * want.abs().amax(dim=1, keepdim=True)).all()
    for bad in (float("inf"), float("-inf"), float("nan")):
        g = gate.clone()
        g[2, 7] = bad
        want = lin(torch.nn.functional.silu(g) * up)
        got = lin.gated(torch.cat([g, up], dim=1))
        assert got[2].isnan().all() and want[2].isnan().all()
        assert torch.equal(got[[0, 1, 3]].isfinite(), torch.ones(3, n, dtype=torch.bool))


def test_fused_rope_and_residual_add_equal_the_torch_ops_after_the_kernel() -> None:
    """``into``/``gated_into`` add the product to the residual as ``x.add_(lin(v))`` does
    (bit for bit); ``roped_by`` rotates the first heads of the normed product as the model's
    torch RoPE does, and leaves the other columns as they were."""
    kernel = _kernel()
    heads, dim, n, k = 3, 16, 64, 128  # 3 rotated heads of 16, then 16 plain columns
    data = _ggml(GGMLQuantizationType.Q4_1, n, k, 12)
    lin = kernels.Q4Linear.pack(from_q4_1(data, n), kernel)
    down = kernels.Q4Linear.pack(
        from_q4_1(_ggml(GGMLQuantizationType.Q4_1, k, n, 13), k), kernel
    )
    gen = torch.Generator().manual_seed(4)
    v, residual = torch.randn(3, k, generator=gen), torch.randn(3, n, generator=gen)
    want = residual + lin(v)
    x = residual.clone()
    assert lin.into(v, x) is x and torch.equal(x, want)
    gate_up, residual = torch.randn(3, 2 * n, generator=gen), torch.randn(3, k, generator=gen)
    want = residual + down.gated(gate_up)
    x = residual.clone()
    assert down.gated_into(gate_up, x) is x and torch.equal(x, want)

    gamma = torch.rand(k, generator=gen) + 0.5
    angles = torch.rand(3, dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)  # first half negated
    table = torch.stack([cos, sin], dim=1).contiguous()  # [3, 2, dim]
    plain = lin.normed(v, gamma, 1e-5)
    qk = plain[:, : heads * dim].reshape(3, heads, dim)
    rotated = qk * cos[:, None] + qk.roll(dim // 2, dims=-1) * sin[:, None]
    got = lin.roped_by(gamma, 1e-5, kernels.Rope(heads, dim))(v, table)
    torch.testing.assert_close(got[:, : heads * dim].reshape(3, heads, dim), rotated)
    assert torch.equal(got[:, heads * dim :], plain[:, heads * dim :])
    roped = lin.roped_by(gamma, 1e-5, kernels.Rope(heads, dim))
    for bad in (table[:2], table[..., :8].contiguous(), table.double()):
        with pytest.raises(ValueError, match="does not take"):
            roped(v, bad)
    with pytest.raises(ValueError, match="does not take"):
        lin.roped_by(gamma, 1e-5, kernels.Rope(5, dim))(v, table)  # 80 columns > 64
    with pytest.raises(ValueError, match="does not take"):
        lin.into(v, torch.zeros(3, n + 1))


def test_fused_mlp_call_equals_its_three_calls() -> None:
    """``MlpBlock`` (one kernel call after a layer's attention) leaves the residual exactly as
    ``into``, ``normed_by`` and ``gated_into`` one after the other do, and refuses what they
    would refuse."""
    kernel = _kernel()
    hidden, q_size, inter = 64, 96, 128
    o = kernels.Q4Linear.pack(
        from_q4_1(_ggml(GGMLQuantizationType.Q4_1, hidden, q_size, 21), hidden), kernel
    )
    gate_up = kernels.Q4Linear.pack(
        from_q4_1(_ggml(GGMLQuantizationType.Q4_1, 2 * inter, hidden, 22), 2 * inter), kernel
    )
    down = kernels.Q4Linear.pack(
        from_q8_0(_ggml(GGMLQuantizationType.Q8_0, hidden, inter, 23), hidden), kernel
    )
    assert down.q8  # one 8-bit projection among them
    gen = torch.Generator().manual_seed(6)
    gamma = torch.rand(hidden, generator=gen) + 0.5
    for rows in (1, 5):
        attn, residual = (
            torch.randn(rows, q_size, generator=gen),
            torch.randn(rows, hidden, generator=gen),
        )
        want = residual.clone()
        o.into(attn, want)
        down.gated_into(gate_up.normed_by(gamma, 1e-5)(want), want)
        got = residual.clone()
        assert kernels.MlpBlock(o, gamma, 1e-5, gate_up, down)(attn, got) is got
        assert torch.equal(got, want)
    block = kernels.MlpBlock(o, gamma, 1e-5, gate_up, down)
    with pytest.raises(ValueError, match="does not take"):
        block(torch.randn(2, q_size), torch.randn(3, hidden))  # rows differ
    with pytest.raises(ValueError, match="does not take"):
        block(torch.randn(2, q_size + 32), torch.randn(2, hidden))
    with pytest.raises(ValueError, match="does not take"):
        kernels.MlpBlock(o, gamma, 1e-5, down, gate_up)  # projections swapped
    with pytest.raises(ValueError, match="does not take"):
        kernels.MlpBlock(o, gamma[:-1], 1e-5, gate_up, down)


def _spied_stack(
    path: Path, weights: str = "auto"
) -> tuple[Any, kernels.DecoderStack, list[int], Callable[..., torch.Tensor]]:
    """The float32 model (``weights`` as ``--weights``), its decoder stack, and a spy on it
    recording each call's rows into the returned list: ``(loaded, stack, batches, spy)``.
    Batch-variant (``batch_invariant="off"``): the layer loop it is compared with then
    attends prefill tokens as the stack does for decode-sized steps only."""
    lm = load_model(path, dtype="float32", weights=weights, progress=False, batch_invariant="off")
    stack = lm.model.stack
    assert isinstance(stack, kernels.DecoderStack)
    batches: list[int] = []

    def spy(
        x: torch.Tensor,
        rope: torch.Tensor,
        attend: NativeAttend,
        lora: Mapping[str, kernels.StackDelta] | None = None,
    ) -> torch.Tensor:
        batches.append(x.shape[0])
        return stack(x, rope, attend, lora)

    return lm, stack, batches, spy


def _small_core(lm: Any) -> Any:
    """A thread-free engine core of 4 sequences over a 32-page pool, seeded, its steps sized
    in tokens alone (``max_step_ms`` 0): the plan, and so each step's rows, must not depend
    on how fast this machine runs them."""
    from kvcache import CacheConfig
    from service.engine.factory import build_core
    from service.engine.tuning import SchedulerTuning
    from service.engine.types import EngineConfig

    config = EngineConfig(
        max_num_seqs=4, max_model_len=256, warmup=False, tuning=SchedulerTuning(max_step_ms=0.0)
    )
    return build_core(
        lm, config, CacheConfig(page_size=16, default_ttl_s=0.0), kv_pages=32, sampler_seed=0
    )


def _add_greedy(
    core: Any, i: int, first: int, prompt: int, n: int, logprobs: int, sink: Callable[..., None]
) -> None:
    """Request ``r{i}`` of tenant ``t{i}``: ``prompt`` ids from ``first + i``, ``n`` greedy
    tokens (no EOS), ``logprobs`` alternatives a token, its events to ``sink``."""
    from service.engine.types import Request, SamplingParams, StoppingParams

    core.add(
        Request(
            request_id=f"r{i}",
            tenant=f"t{i}",
            prompt_ids=tuple(range(first + i, first + i + prompt)),
            sampling=SamplingParams(temperature=0.0),
            stopping=StoppingParams(max_tokens=n, ignore_eos=True),
            logprobs=logprobs,
        ),
        sink,
    )



def _greedy_alone(lm: Any, i: int, first: int, prompt: int, n: int) -> list[tuple[int, float]]:
    """:func:`_add_greedy`'s request ``r{i}`` alone on a fresh :func:`_small_core`: its
    (token, logprob) pairs."""
    from service.engine.types import Delta

    core = _small_core(lm)
    got: list[tuple[int, float]] = []

    def sink(event: Any) -> None:
        if isinstance(event, Delta):
            got.extend((lp.token_id, lp.logprob) for lp in event.logprobs)

    _add_greedy(core, i, first, prompt, n, 1, sink)
    with torch.inference_mode():
        while core.has_work():
            core.step()
    return got

@pytest.mark.slow
def test_decoder_stack_decodes_bit_for_bit_as_the_layer_loop(default_model_path: Path) -> None:
    """An all-decode float32 step runs every layer in one native call (``DecoderStack``, with
    kvcache's ``NativeAttend`` for the K/V write and attention); steps with more tokens than
    the packs take keep the layer loop. Three sequences that finish at different steps decode the same
    tokens with bit-identical logprobs either way, and the stack ran on exactly the
    all-decode steps."""
    from service.engine.types import Delta, EngineEvent

    lm, stack, batches, spy = _spied_stack(default_model_path)
    model = lm.model

    def run(use: bool) -> tuple[list[list[tuple[int, float, tuple[tuple[int, float], ...]]]], int]:
        model.use_stack(spy if use else None)
        core = _small_core(lm)
        got: list[list[tuple[int, float, tuple[tuple[int, float], ...]]]] = [[], [], []]
        for i, (prompt, n) in enumerate(((20, 6), (33, 9), (47, 12))):

            def sink(
                event: EngineEvent,
                out: list[tuple[int, float, tuple[tuple[int, float], ...]]] = got[i],
            ) -> None:
                if isinstance(event, Delta):
                    out.extend((lp.token_id, lp.logprob, lp.top) for lp in event.logprobs)

            _add_greedy(core, i, 200, prompt, n, 3, sink)
        steps = 0
        with torch.inference_mode():
            while core.has_work():
                core.step()
                steps += 1
        return got, steps

    try:
        want, steps = run(False)
        assert not batches
        got, _ = run(True)
    finally:
        model.use_stack(stack)
    assert [len(g) for g in want] == [6, 9, 12]
    assert got == want
    # one prefill step for all three, then decode steps of 3, 2 and 1 rows
    assert batches == [3] * 5 + [2] * 3 + [1] * 3
    assert steps == 1 + len(batches)


@pytest.mark.slow
def test_decoder_stack_runs_steps_with_short_prefill_chunks(default_model_path: Path) -> None:
    """Steps that carry prefill chunks small enough for the packs run through the stack too,
    each chunk token a row of kvcache's decode kernel over its own prefix: two prompts
    prefilled together, then a third arriving beside their decodes, give the same greedy
    tokens as the layer loop (SDPA for the chunks), with logprobs within 0.01."""
    from service.engine.types import Delta, EngineEvent

    lm, stack, batches, spy = _spied_stack(default_model_path)
    model = lm.model

    Out = list[tuple[int, float]]

    def run(use: bool) -> list[Out]:
        model.use_stack(spy if use else None)
        core = _small_core(lm)
        got: list[Out] = [[], [], []]

        def add(i: int, prompt: int, n: int) -> None:
            def sink(event: EngineEvent, out: Out = got[i]) -> None:
                if isinstance(event, Delta):
                    out.extend((lp.token_id, lp.logprob) for lp in event.logprobs)

            _add_greedy(core, i, 300, prompt, n, 1, sink)

        add(0, 12, 6)
        add(1, 9, 5)
        with torch.inference_mode():
            core.step()
            core.step()
            add(2, 7, 4)
            while core.has_work():
                core.step()
        return got

    try:
        want = run(False)
        assert not batches
        got = run(True)
    finally:
        model.use_stack(stack)
    assert [len(g) for g in want] == [6, 5, 4]
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in g] for g in want]
    for g, w in zip(got, want, strict=True):
        # (float32 rounding in the attention, then the GEMV's int16 rounding of its input,
        # through 30 layers: the decode tests above see logits within 0.01)
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w, strict=True)) < 1e-2
    # the two prompts together (21 tokens), a decode step, then the third prompt's 7
    # tokens beside the two decodes
    assert batches[:3] == [21, 2, 9]


@pytest.mark.slow
def test_decoder_stack_refuses_a_step_it_does_not_fit(default_model_path: Path) -> None:
    """The stack checks the step's attention against its own shapes before the native call,
    and a KV row outside the pool is refused: by ``step_context`` when it is made, and by
    kvcache's C call in the stack when the rows change after (nothing written, the residual
    stream stays the embeddings)."""
    from kvcache.metadata import kv_rows

    lm = load_model(default_model_path, dtype="float32", weights="auto", progress=False)
    stack = lm.model.stack
    assert isinstance(stack, kernels.DecoderStack)
    c = lm.model.config
    decode = cpu_decode.kernel()
    assert decode is not None
    pages = 4
    pool = torch.zeros(c.num_layers, pages, 2, 16, c.num_kv_heads, c.head_dim)
    indptr, indices = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    x = torch.randn(1, c.hidden_size)
    rope = lm.model.rope[torch.tensor([4])]
    outside = kv_rows(torch.tensor([pages * 16]), 16)  # one page past the pool
    with pytest.raises(KernelRefused, match="outside the layer"):
        decode.step_context(c.num_heads, pool, outside, indptr, indices, lens)
    moved = kv_rows(torch.tensor([2 * 16 + 4]), 16)
    attend = decode.step_context(c.num_heads, pool, moved, indptr, indices, lens)
    moved.copy_(outside)  # the context points at these rows: the C call checks them again
    before = x.clone()
    with pytest.raises(KernelRefused, match="nothing was written"):
        stack(x, rope, attend)
    assert torch.equal(x, before) and not pool.any()
    rows = kv_rows(torch.tensor([2 * 16 + 4]), 16)
    good = decode.step_context(c.num_heads, pool, rows, indptr, indices, lens)
    for bad in (
        (
            torch.randn(2, c.hidden_size),
            lm.model.rope[torch.tensor([4, 5])],
            good,
        ),  # 2 rows, 1 sequence
        (x, rope, decode.step_context(c.num_heads, pool[:3], rows, indptr, indices, lens)),
        (x.double(), rope, good),
        (x, rope[:, :, :-2].contiguous(), good),
    ):
        with pytest.raises(ValueError, match="does not take"):
            stack(*bad)
    assert not pool.any()
    assert stack(x, rope, good) is x and pool.any()


@pytest.mark.slow
def test_auto_on_a_bf16_cpu_decodes_float32_through_the_kernel_and_batches_dense_bf16(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("service.model.loader.tier_has_bf16", lambda: True)
    assert resolve_precision("auto", "cpu", "auto") == (torch.float32, torch.bfloat16)
    assert resolve_precision("auto", "cpu", "int4") == (torch.float32, torch.bfloat16)
    # no 4-bit decode weights, an explicit dtype, or no kernel: one dtype throughout
    assert resolve_precision("auto", "cpu", "bf16") == (torch.bfloat16, torch.bfloat16)
    assert resolve_precision("auto", "cpu", "int8") == (torch.bfloat16, torch.bfloat16)
    assert resolve_precision("float32", "cpu", "auto") == (torch.float32, torch.float32)
    assert resolve_precision("auto", "cuda", "auto") == (torch.bfloat16, torch.bfloat16)
    # the batch-variant fast paths (--batch-invariant off); the invariant ones: below
    lm = load_model(default_model_path, weights="auto", progress=False, batch_invariant="off")
    fp32 = load_model(
        default_model_path, dtype="float32", weights="auto", progress=False, batch_invariant="off"
    )
    m, ref = lm.model, fp32.model
    assert lm.dtype == torch.float32 and lm.dense_dtype == torch.bfloat16
    assert m.embed.dtype == torch.float32 and m.attn_norm.dtype == torch.float32
    assert {m.qkv.dtype, m.o.dtype, m.gate_up.dtype, m.down.dtype} == {torch.bfloat16}
    # beside bf16 dense weights the packs take up to 16 rows where the kernel runs the panel
    # layout on SIMD (the packs are panels then), else 64 where it runs batches on the tile
    # unit (AMX), else 4; float32 dense weights take 32 (float32 throughout)
    kernel = _kernel()
    assert m.max_packed_rows == (16 if kernel.panel_simd else 64 if kernel.amx else 4)
    assert ref.max_packed_rows == 32
    assert m.packed is not None and ref.packed is not None
    head, ref_head = m.packed.lm_head, ref.packed.lm_head
    assert isinstance(head, kernels.Q4Linear) and isinstance(ref_head, kernels.Q4Linear)
    assert head.panels == ref_head.panels == kernel.panel_simd
    assert head.tiles == (kernel.amx and not kernel.panel_simd) and not ref_head.tiles
    assert m.stack is not None
    # the KV cache is stored in the dense weights' dtype: bf16 here, float32 for the oracle
    assert m.kv_dtype == torch.bfloat16 and ref.kv_dtype == torch.float32

    def logits(model: torch.nn.Module, n: int) -> torch.Tensor:
        ids = torch.arange(1, n + 1) * 97
        out: torch.Tensor = model(ids, torch.arange(n), DenseAttention(30))
        return out

    # decode-sized: the same float32 kernel calls as the float32 model, bit for bit
    assert torch.equal(logits(m, 4), logits(ref, 4))
    # larger batches compute in bf16 (the dense bf16 weights, or the tile unit from the
    # blocks where the packs are not panels): close to float32, not equal to it
    for n in (20, 70):
        a, b = logits(m, n), logits(ref, n)
        assert a.dtype == torch.float32
        assert not torch.equal(a, b)
        assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()


@pytest.mark.slow
def test_auto_on_a_bf16_cpu_without_the_kernel_computes_bf16(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("service.model.loader.tier_has_bf16", lambda: True)
    monkeypatch.setenv("KVFENCE_CPU_KERNEL", "off")
    assert resolve_precision("auto", "cpu", "auto") == (torch.bfloat16, torch.bfloat16)
    lm = load_model(default_model_path, weights="auto", progress=False)
    assert lm.dtype == torch.bfloat16 and lm.dense_dtype is None


@pytest.mark.slow
def test_the_invariant_model_has_one_kernel_for_every_batch_size(
    default_model_path: Path,
) -> None:
    """``--batch-invariant on`` on this CPU: every projection and the head on
    the float32 GEMV with the tile unit off, at any row count, and one cost regime for the
    scheduler. A row's product is the same bits in a batch of 1, 3, 4, 5, 8, 70 or 130 rows
    at any place in it (the tile unit, or the dense weights past 64 rows, would round
    differently)."""
    lm = load_model(default_model_path, progress=False, batch_invariant="on")
    m = lm.model
    assert lm.batch_invariant and m.batch_invariant and m.max_packed_rows == 0
    assert m.packed is not None and m.stack is not None
    packs = [*m.packed.qkv, *m.packed.o, *m.packed.gate_up, *m.packed.down, m.packed.lm_head]
    assert all(isinstance(p, kernels.Q4Linear) and not p.tiles for p in packs)
    # where the kernel runs the panel layout on SIMD, every projection and the head (their
    # rows fill panels of 16) are on it: one exact integer a block, the fast batches
    kernel = packs[0].kernel
    assert all(p.panels == kernel.panel_simd for p in packs)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(130, m.config.hidden_size, generator=gen)
    for lin in (m.packed.qkv[0], m.packed.lm_head):
        assert lin is not None
        alone = torch.cat([lin(rows[i : i + 1]) for i in range(rows.shape[0])])
        for n in (3, 4, 5, 8, 70, 130):
            for start in (0, rows.shape[0] - n):
                assert torch.equal(lin(rows[start : start + n]), alone[start : start + n]), n
    default = load_model(default_model_path, progress=False)  # --batch-invariant auto
    assert default.batch_invariant and default.model.max_packed_rows == 0
    off = load_model(default_model_path, progress=False, batch_invariant="off")
    assert not off.batch_invariant and off.model.max_packed_rows > 0
    with pytest.raises(ModelLoadError, match="--batch-invariant on"):
        load_model(default_model_path, weights="bf16", progress=False, batch_invariant="on")


@pytest.mark.slow
def test_the_invariant_model_turns_the_tile_unit_off_for_weights_left_out_of_panels(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight whose rows do not fill panels of 16 keeps the row layout, where the default
    packs take the tile unit (bf16) on an AMX CPU; the invariant model turns it off. Here
    every weight of the default model is left out of panels."""
    monkeypatch.setattr(kernels.Q4Linear, "in_panels", lambda self: self)

    def packs(batch_invariant: str) -> list[kernels.Q4Linear]:
        m = load_model(default_model_path, progress=False, batch_invariant=batch_invariant).model
        assert m.packed is not None
        got = [*m.packed.qkv, *m.packed.o, *m.packed.gate_up, *m.packed.down, m.packed.lm_head]
        q4 = [p for p in got if isinstance(p, kernels.Q4Linear)]
        assert len(q4) == len(got)
        return q4

    variant = packs("off")
    if not variant[0].kernel.amx:
        pytest.skip("no tile unit on this CPU: every pack is off it already")
    assert all(p.tiles for p in variant)
    assert not any(p.tiles for p in packs("on"))
