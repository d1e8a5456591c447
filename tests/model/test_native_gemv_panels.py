"""The 4-bit GEMV's panel layout (``service/model/native/panels.h``, :func:`kernels.to_panels`),
which batch-invariant steps run: one exact integer per (row, output, block), then one float
chain per output in block order, so a row's output is the same bits in a batch of any size
and at any place in it, on the SIMD loops and on the plain C ones alike."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcache import native_build
from service.model.invariance import invariant_linear
from service.model.native import kernels
from service.model.quant import Int4Codes

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVFENCE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", {})
    yield


def _kernel(portable: bool, tmp_path: Path) -> kernels.Q4Kernel:
    if not portable:
        kernel = kernels.kernel()
        assert kernel is not None, "a C compiler is here: the kernel must build"
        return kernel
    target = tmp_path / "portable.so"
    native_build.compile_library(str(shutil.which("cc")), kernels.SOURCE, target, "x86-64")
    kernel = kernels.Q4Kernel(ctypes.CDLL(str(target)))
    assert not kernel.panel_simd
    return kernel


def _codes(n: int, k: int, seed: int) -> Int4Codes:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    zero = (torch.randn(n, k // 32, generator=gen) * 0.05).half().float()
    return Int4Codes(codes, scale, zero)


def _panels(w: Int4Codes) -> torch.Tensor:
    return kernels.to_panels(kernels.to_blocks(w), w.codes.shape[1])


def _q8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit blocks in the kernel's row layout, with their int8 codes and fp16 scales."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half()
    return kernels._rows(codes, kernels._padded(d)), codes, d


def _weights(q8: bool, n: int, k: int, seed: int) -> torch.Tensor:
    """Random weights in the panel layout, 4-bit or 8-bit."""
    return kernels.to_panels(_q8(n, k, seed)[0], k, True) if q8 else _panels(_codes(n, k, seed))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("q8", [False, True], ids=["q4", "q8"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_a_rows_output_is_the_same_bits_alone_or_in_any_batch(
    portable: bool, q8: bool, tmp_path: Path
) -> None:
    n, k, total = 48, 576, 300  # 18 blocks a row: not a multiple of the scales' 8
    kernel = _kernel(portable, tmp_path)
    blocks = _weights(q8, n, k, 1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(total, k, generator=gen) * torch.exp(2 * torch.randn(total, 1, generator=gen))
    alone = torch.cat([kernel.matmul(x[i : i + 1], blocks, q8, panels=True) for i in range(total)])
    for m in (1, 3, 4, 5, 17, 64, 300):
        for start in {0, total - m, (total - m) // 2 + 1 if m < total else 0}:
            got = kernel.matmul(x[start : start + m], blocks, q8, panels=True)
            assert torch.equal(_bits(got), _bits(alone[start : start + m])), (m, start)
    # a residual add rounds as out + product, row by row
    into = torch.randn(17, n, generator=gen)
    want = into + alone[:17]
    got = kernel.matmul(x[:17], blocks, q8, panels=True, into=into.clone())
    assert torch.equal(_bits(got), _bits(want))


def _f32(v: Fraction) -> float:
    """``v`` rounded once to the nearest float32 (ties to even)."""
    if v == 0:
        return 0.0
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)
    mantissa = round(a / Fraction(2) ** (e - 23))  # Fraction rounds half to even
    return float(np.float32((1 if v > 0 else -1) * mantissa * 2.0 ** (e - 23)))


def _reference(x: np.ndarray, codes: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """The panel layout's defined arithmetic (panels.h), one output at a time: x's int16
    blocks as prepare() makes them, S_g exact, acc = fma(S_g, d_g * s_g, acc) and
    mac = fma(m_g, t_g, mac) in block order (m = 0 for 8-bit blocks), then acc + mac;
    every FMA rounded once."""
    rows, k = x.shape
    n, groups = codes.shape[0], k // 32
    out = np.zeros((rows, n), dtype=np.float32)
    for r in range(rows):
        xb = x[r].reshape(groups, 32)
        top = np.abs(xb).max(axis=1).astype(np.float32)
        inv = np.float32(32767.0) / top
        q = np.rint((xb * inv[:, None]).astype(np.float32)).astype(np.int64)
        step = (top / np.float32(32767.0)).astype(np.float32)
        sums = xb.astype(np.float64).sum(axis=1)  # exact: x is dyadic with few bits
        for o in range(n):
            acc = mac = 0.0
            for g in range(groups):
                s = int((codes[o, g * 32 : g * 32 + 32].astype(np.int64) * q[g]).sum())
                scale = float(np.float32(d[o, g]) * step[g])
                # (float)S_g: exact for 4-bit codes, rounded once for 8-bit ones
                acc = _f32(Fraction(_f32(Fraction(s))) * Fraction(scale) + Fraction(acc))
                minimum = 0.0 if m is None else float(m[o, g])
                mac = _f32(Fraction(minimum) * Fraction(float(sums[g])) + Fraction(mac))
            out[r, o] = np.float32(acc) + np.float32(mac)
    return out


@pytest.mark.parametrize("q8", [False, True], ids=["q4", "q8"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_panels_compute_the_defined_sums_in_block_order(
    portable: bool, q8: bool, tmp_path: Path
) -> None:
    """Bit for bit the arithmetic panels.h documents for the panel layout, for a batch of
    5 (a group of four rows and a single one) and of 18 (the tile unit where the CPU has
    it); another order of the float steps, or float partial sums inside a block, would
    round differently."""
    n, k = 32, 96
    kernel = _kernel(portable, tmp_path)
    groups = k // 32
    if q8:
        blocks, codes, d16 = _q8(n, k, 3)
        d, m, codes_np = d16.float().numpy(), None, codes.to(torch.int64).numpy()
    else:
        w = _codes(n, k, 3)
        blocks = kernels.to_blocks(w)
        tail = blocks[:, groups * 16 :].contiguous()
        d = tail[:, : 2 * groups].contiguous().view(torch.float16).float().numpy()
        m = tail[:, 16 : 16 + 2 * groups].contiguous().view(torch.float16).float().numpy()
        codes_np = w.codes.numpy()
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(-4000, 4000, (18, k), generator=gen).float() / 1024
    x[1] /= 1024  # rows of different sizes (dyadic: the block sums are exact)
    want = torch.from_numpy(_reference(x.numpy(), codes_np, d, m))
    panels = kernels.to_panels(blocks, k, q8)
    for rows in (5, 18):
        got = kernel.matmul(x[:rows], panels, q8, panels=True)
        assert torch.equal(_bits(got), _bits(want[:rows])), rows


def test_panels_approximate_the_float_product_and_carry_non_finite_rows() -> None:
    n, k = 64, 1536
    kernel = kernels.kernel()
    assert kernel is not None
    w = _codes(n, k, 5)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(6))
    got = kernel.matmul(x, _panels(w), panels=True).double()
    dense = w.dequantize().double()
    exact = x.double() @ dense.T
    # int16 rounding: at most half a step (max |x| of the row / 32767) per element
    bound = x.abs().amax(1, keepdim=True).double() / 32767 * dense.abs().sum(1) + 1e-5 * (
        x.double().abs() @ dense.abs().T
    )
    assert ((got - exact).abs() <= bound).all()
    x[2, 700] = float("nan")
    x[4, 3] = float("inf")
    bad = kernel.matmul(x, _panels(w), panels=True)
    assert bad[2].isnan().all() and bad[4].isnan().all()
    assert torch.equal(bad[[0, 1, 3, 5]].double(), got[[0, 1, 3, 5]])


def test_the_kernel_refuses_panels_it_cannot_run() -> None:
    kernel = kernels.kernel()
    assert kernel is not None
    blocks = _panels(_codes(32, 64, 7))
    with pytest.raises(ValueError, match="does not take"):
        kernel.matmul(torch.zeros(1, 64), blocks[:24], panels=True)  # not whole panels
    with pytest.raises(ValueError, match="does not take"):
        kernel.matmul(torch.zeros(1, 64), blocks[:, :-1].contiguous(), panels=True)
    lin = kernels.Q4Linear.pack(_codes(24, 64, 8), kernel)
    assert not invariant_linear(lin).panels  # 24 rows: not whole panels, stays on the int16 GEMV
    full = invariant_linear(kernels.Q4Linear.pack(_codes(32, 64, 8), kernel))
    assert full.panels == kernel.panel_simd and not full.tiles
