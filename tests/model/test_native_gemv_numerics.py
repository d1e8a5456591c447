"""The 4-bit GEMV's numerics and memory on every build (native SIMD, AVX2 without VNNI,
plain C): tiny blocks take an exact power-of-two step instead of overflowing, a strided norm
weight is read through a copy that outlives the call, and per-thread scratch is freed when
its thread exits."""

from __future__ import annotations

import ctypes
import shutil
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvcache import native_build
from service.model.native import kernels
from service.model.quant import quantize_int4

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

BUILDS = {"native": None, "avx2": "x86-64-v3", "portable": "x86-64"}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, kernels.Q4Kernel]:
    """The other builds, each made once for the module."""
    made: dict[str, kernels.Q4Kernel] = {}
    for build, arch in BUILDS.items():
        if arch is not None:
            target = tmp_path_factory.mktemp("builds") / f"{build}.so"
            native_build.compile_library(
                str(shutil.which("cc")), kernels.SOURCE, target, arch, native_build.extra_flags()
            )
            made[build] = kernels.Q4Kernel(ctypes.CDLL(str(target)))
    return made


@pytest.fixture
def built(builds: dict[str, kernels.Q4Kernel]) -> Callable[[str], kernels.Q4Kernel]:
    def get(build: str) -> kernels.Q4Kernel:
        if BUILDS[build] is not None:
            return builds[build]
        kernel = kernels.kernel()
        assert kernel is not None, "a C compiler is here: the kernel must build"
        return kernel

    return get


def _packed(kernel: kernels.Q4Kernel, n: int, k: int, seed: int) -> kernels.Q4Linear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return kernels.Q4Linear.pack(quantize_int4(w), kernel)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("scale", [1e-36, 1e-31, 1e-20], ids=["1e-36", "1e-31", "1e-20"])
def test_tiny_blocks_keep_their_sign_and_size(
    build: str, scale: float, built: Callable[[str], kernels.Q4Kernel]
) -> None:
    """A row whose blocks' largest |x| is below ~1e-34 once overflowed 32767 / top (every
    value read as -32768: the wrong sign, ~100x too large); now it is the product to float32
    accuracy, as the same row scaled up by a power of two is."""
    kernel = built(build)
    lin = _packed(kernel, 40, 64, 1)
    dense = lin(torch.eye(64)).T  # the weights as the kernel reads them (exact at this size)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    x[1, 32:64] = 0.0  # an all-zero block among tiny ones
    tiny = x * scale
    got = lin(tiny).double()
    exact = tiny.double() @ dense.double().T
    big = lin(x).double() * scale  # the same row at an ordinary size, scaled back
    assert (got.sign() == exact.sign()).float().mean() > 0.97
    tol = 2e-3 * exact.abs().max()  # float32 products of ~1e-36 lose low bits (subnormals)
    assert (got - exact).abs().max() <= tol
    assert (got - big).abs().max() <= tol


@pytest.mark.parametrize("build", list(BUILDS))
def test_a_strided_norm_weight_is_read_as_its_values(
    build: str, built: Callable[[str], kernels.Q4Kernel]
) -> None:
    """``gamma`` not contiguous: the kernel reads a contiguous copy, which must outlive the
    call (a pointer to a freed temporary gave errors up to 7.0)."""
    kernel = built(build)
    lin = _packed(kernel, 64, 128, 3)
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(128, 2, generator=gen) + 1.0
    strided = wide[:, 0]
    assert not strided.is_contiguous()
    x = torch.randn(2, 128, generator=gen)
    want = kernel.matmul(x, lin.blocks, gamma=strided.contiguous(), eps=1e-5)
    for _ in range(20):  # allocations between the copy and the call would reuse freed memory
        got = kernel.matmul(x, lin.blocks, gamma=strided, eps=1e-5)
        assert torch.equal(got, want)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("n", [64, 4096], ids=["one thread", "workers"])
def test_a_threads_scratch_is_freed_when_it_exits(
    build: str, n: int, built: Callable[[str], kernels.Q4Kernel]
) -> None:
    """Each calling thread (and each OpenMP worker of a parallel call) keeps its scratch
    between calls, on the heap, and gives it back when the thread exits."""
    kernel = built(build)
    lin = _packed(kernel, n, 128, 5)
    x = torch.randn(4, 128)
    before = kernel.scratch_threads()
    during: list[int] = []

    def work() -> None:
        lin(x)
        during.append(kernel.scratch_threads())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert during[0] >= before + 1
    deadline = time.monotonic() + 5  # OpenMP workers leave after their master thread
    while kernel.scratch_threads() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kernel.scratch_threads() == before
