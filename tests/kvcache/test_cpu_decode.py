"""The C decode kernel (kvcache/backends/cpu_decode.c): built from source on first use,
against float32 attention over each sequence's own pages, and off without a compiler."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcache import native_build
from kvcache.backends import cpu_decode
from kvcache.errors import KernelRefused

PAGE, HKV, GROUP, DIM = 16, 3, 3, 64


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No kernel loaded yet in this process, and an empty kernel cache."""
    monkeypatch.setattr(cpu_decode, "_loaded", {})
    monkeypatch.setenv("KVFENCE_HOME", str(tmp_path))
    return tmp_path / "kernels"


def _reference(q: torch.Tensor, layer: torch.Tensor, pages: list[list[int]], lens: list[int]):
    out = []
    for b, (own, n) in enumerate(zip(pages, lens, strict=True)):
        idx = torch.tensor(own)
        k = layer[idx, 0].reshape(-1, HKV, DIM)[:n].float()
        v = layer[idx, 1].reshape(-1, HKV, DIM)[:n].float()
        qq = q[b].float().view(HKV, GROUP, DIM)
        p = (torch.einsum("hgd,nhd->hgn", qq, k) * DIM**-0.5).softmax(-1)
        out.append(torch.einsum("hgn,nhd->hgd", p, v).reshape(HKV * GROUP, DIM))
    return torch.stack(out)


def _metadata(pages: list[list[int]], lens: list[int]) -> tuple[torch.Tensor, ...]:
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + len(p))
    flat = [x for p in pages for x in p]
    return (
        torch.tensor(indptr, dtype=torch.int32),
        torch.tensor(flat, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
    )


def _built_for(tmp_path: Path, march: str) -> cpu_decode.DecodeKernel:
    """The kernel built for another x86-64 level: ``x86-64-v2`` the plain C loops,
    ``x86-64-v3`` the AVX2 float32 path (without AVX512); with this run's extra flags
    (``make sanitize``'s)."""
    target = tmp_path / f"{march}.so"
    native_build.compile_library(
        str(shutil.which("cc")), cpu_decode.SOURCE, target, march, native_build.extra_flags()
    )
    return cpu_decode.DecodeKernel(ctypes.CDLL(str(target)))


@pytest.fixture(scope="module")
def built_for(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], cpu_decode.DecodeKernel]:
    """:func:`_built_for`, each ``march`` built once for the module."""
    made: dict[str, cpu_decode.DecodeKernel] = {}

    def get(march: str) -> cpu_decode.DecodeKernel:
        if march not in made:
            made[march] = _built_for(tmp_path_factory.mktemp("builds"), march)
        return made[march]

    return get


def _has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def _build(
    build: str, built_for: Callable[[str], cpu_decode.DecodeKernel]
) -> cpu_decode.DecodeKernel:
    """This CPU's kernel (``native``), or the ``avx2`` or ``portable`` build (checked on
    x86-64 with AVX2 only)."""
    if build == "native":
        kernel = cpu_decode.kernel()
        assert kernel is not None
        return kernel
    if platform.machine() != "x86_64" or (build == "avx2" and not _has_avx2()):
        pytest.skip("the other builds are checked on x86-64 with AVX2")
    return built_for("x86-64-v3" if build == "avx2" else "x86-64-v2")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
@pytest.mark.parametrize(
    ("dtype", "pool_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),  # float32 compute, KV stored in bf16
    ],
    ids=["bf16", "float32", "float32-over-bf16"],
)
def test_kernel_builds_and_matches_float32_attention(
    build: str,
    dtype: torch.dtype,
    pool_dtype: torch.dtype,
    fresh: Path,
    built_for: Callable[[str], cpu_decode.DecodeKernel],
) -> None:
    kernel = _build(build, built_for)
    if build == "native":
        assert len(list(fresh.glob("cpu_decode-*.so"))) == 1
    torch.manual_seed(0)
    layer = torch.randn(40, 2, PAGE, HKV, DIM).to(pool_dtype)
    # Lengths on and off page boundaries, one key, and scattered, out-of-order pages.
    lens = [1, 16, 17, 100, 250]
    order = torch.randperm(40).tolist()
    pages, used = [], 0
    for n in lens:
        count = -(-n // PAGE)
        pages.append(order[used : used + count])
        used += count
    q = torch.randn(len(lens), HKV * GROUP, DIM).to(dtype)
    out = kernel.run(q, layer, *_metadata(pages, lens))
    assert out.dtype == dtype
    want = _reference(q, layer, pages, lens)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 output rounding, or float32 sums
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    # Pages nobody named can hold anything: poison them all.
    named = {x for p in pages for x in p}
    for page in set(range(40)) - named:
        layer[page] = float("nan")
    again = kernel.run(q, layer, *_metadata(pages, lens))
    assert torch.equal(out, again)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_kernel_refuses_what_it_cannot_take(fresh: Path) -> None:
    kernel = cpu_decode.kernel()
    assert kernel is not None
    layer = torch.zeros(4, 2, PAGE, HKV, DIM).bfloat16()
    q = torch.zeros(1, HKV * GROUP, DIM).bfloat16()
    good = _metadata([[0]], [3])
    with pytest.raises(ValueError, match="dtype"):
        kernel.run(q, layer.float(), *good)  # bf16 queries over a float32 pool
    with pytest.raises(ValueError, match="int32"):
        kernel.run(q, layer, good[0].long(), good[1], good[2])
    with pytest.raises(ValueError, match="one length per sequence"):
        kernel.run(q, layer, *_metadata([[0], [1]], [3, 3]))
    assert not kernel.supports(HKV * GROUP, layer.half())
    assert kernel.supports(HKV * GROUP, layer.float())


def test_no_compiler_means_the_torch_path(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "kvfence-no-such-compiler")
    assert cpu_decode.kernel() is None
    assert not fresh.exists()


def test_switched_off(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFENCE_CPU_KERNEL", "off")
    assert cpu_decode.kernel() is None


def test_loading_the_kernel_keeps_subnormal_numbers() -> None:
    """Built with -ffast-math, the library set flush-to-zero for the whole process when it
    loaded: a request's temperature of 1e-45 then read as 0 (greedy) instead of being
    refused. Checked in a fresh interpreter, so nothing else loaded it first."""
    code = (
        "from kvcache.backends import cpu_decode\n"
        "assert cpu_decode.kernel() is not None\n"
        "import struct\n"
        "tiny = struct.unpack('f', struct.pack('f', 1e-45))[0]\n"
        "assert tiny * 1.0 > 0 and 5e-324 * 1.0 > 0, 'subnormals flushed to zero'\n"
    )
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def test_fused_write_and_attend_equals_the_write_then_the_kernel(dtype: torch.dtype) -> None:
    """``write_run`` (the compiled step's one call a layer) stores K/V where
    ``write_kv_rows`` does, touches no other row or layer, and attends like ``run``; a row
    outside the layer is refused before anything is written."""
    from kvcache.metadata import kv_rows, write_kv_rows

    kernel = cpu_decode.kernel()
    assert kernel is not None
    torch.manual_seed(1)
    pool = torch.randn(3, 12, 2, PAGE, HKV, DIM).to(dtype)
    pages, lens = [[4, 9], [2]], [20, 7]  # each sequence's new token is its last key
    slots = torch.tensor([9 * PAGE + 3, 2 * PAGE + 6])
    rows = kv_rows(slots, PAGE)
    q = torch.randn(2, HKV * GROUP, DIM).to(dtype)
    k = torch.randn(2, HKV, DIM).to(dtype)
    v = torch.randn(2, HKV, DIM).to(dtype)
    meta = _metadata(pages, lens)
    want_pool = pool.clone()
    write_kv_rows(want_pool[1], k, v, rows)
    want = kernel.run(q, want_pool[1], *meta)
    got = kernel.write_run(q, k, v, pool, 1, rows, *meta)
    assert torch.equal(pool, want_pool)
    assert torch.equal(got, want)
    before = pool.clone()
    outside = rows.clone()
    outside[1, 1] = 12 * 2 * PAGE  # one past the layer's last row
    with pytest.raises(KernelRefused, match="outside the layer; nothing was written"):
        kernel.write_run(q, k * 2, v * 2, pool, 1, outside, *meta)
    with pytest.raises(ValueError, match="does not take"):
        kernel.write_run(q, k, v, pool, 3, rows, *meta)
    with pytest.raises(ValueError, match="int32"):
        kernel.write_run(q, k, v, pool, 1, rows, meta[0].long(), meta[1], meta[2])
    assert torch.equal(pool, before)


def _two_layer_step(
    seed: int,
) -> tuple[cpu_decode.DecodeKernel, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, tuple[torch.Tensor, ...]]:
    """The kernel, a float32 pool of 2 layers, and one all-decode step of two sequences (on
    pages 4, 9 and on page 2, 20 and 7 keys): (kernel, pool, metadata, rows, (q, k, v))."""
    from kvcache.metadata import kv_rows

    kernel = cpu_decode.kernel()
    assert kernel is not None
    torch.manual_seed(seed)
    pool = torch.randn(2, 12, 2, PAGE, HKV, DIM)
    meta = _metadata([[4, 9], [2]], [20, 7])
    rows = kv_rows(torch.tensor([9 * PAGE + 3, 2 * PAGE + 6]), PAGE)
    qkv = tuple(torch.randn(2, h, DIM) for h in (HKV * GROUP, HKV, HKV))
    return kernel, pool, meta, rows, qkv


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_layer_writer_checks_once_then_each_layer_against_the_first() -> None:
    """``layer_writer`` (the eager all-decode step's call a layer) writes and attends as
    ``write_run`` does, on each layer's view; a layer's tensors of another shape, dtype or
    layout are refused, and a row outside the layer is refused with nothing written."""
    kernel, pool, meta, rows, (q, k, v) = _two_layer_step(2)
    write = kernel.layer_writer(q, k, v, pool[0], rows, *meta)
    want_pool = pool.clone()
    for layer in (0, 1):
        want = kernel.write_run(q, k, v, want_pool, layer, rows, *meta)
        assert torch.equal(write(q, k, v, pool[layer]), want)
        assert torch.equal(pool, want_pool)
    before = pool.clone()
    for bad in (
        (q[:1], k[:1], v[:1], pool[1]),  # another batch
        (q, k.bfloat16(), v, pool[1]),  # another dtype
        (q, k, v.transpose(1, 2).contiguous().transpose(1, 2), pool[1]),  # not contiguous
        (q, k, v, pool[1, :6]),  # another layer shape
    ):
        with pytest.raises(ValueError, match="does not take"):
            write(*bad)
    outside = rows.clone()
    outside[1, 1] = 12 * 2 * PAGE  # one past the layer's last row
    with pytest.raises(KernelRefused, match="outside the layer; nothing was written"):
        kernel.layer_writer(q, k, v, pool[0], outside, *meta)(q, k * 2, v * 2, pool[0])
    with pytest.raises(ValueError, match="does not take"):
        kernel.layer_writer(q.bfloat16(), k, v, pool[0], rows, *meta)
    assert torch.equal(pool, before)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_step_context_attends_each_layer_as_write_run() -> None:
    """``step_context`` (a float32 all-decode step's attention for native model code) hands
    out a C function that, given only a layer index and the caller's q/k/v/out buffers,
    writes and attends exactly as ``write_run`` on that layer; a layer outside the pool or a
    row outside the layer is refused with nothing written, and the step's metadata is
    checked once, when the context is made."""
    kernel, pool, meta, rows, (q, k, v) = _two_layer_step(3)
    native = kernel.step_context(HKV * GROUP, pool, rows, *meta)
    assert (native.batch, native.q_heads, native.kv_heads, native.head_dim) == (
        2, HKV * GROUP, HKV, DIM,
    )
    assert native.num_layers == 2
    attend = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 4
    )(native.fn)

    def call(layer: int, kk: torch.Tensor, vv: torch.Tensor, ctx: int = native.ctx) -> tuple[int, torch.Tensor]:
        out = torch.empty_like(q)
        status = attend(ctx, layer, q.data_ptr(), kk.data_ptr(), vv.data_ptr(), out.data_ptr())
        return status, out

    want_pool = pool.clone()
    for layer in (1, 0):
        want = kernel.write_run(q, k, v, want_pool, layer, rows, *meta)
        status, got = call(layer, k, v)
        assert status == 0
        assert torch.equal(got, want)
        assert torch.equal(pool, want_pool)
    before = pool.clone()
    for layer in (2, -1):
        assert call(layer, k * 2, v * 2)[0] == -1
    outside = rows.clone()
    outside[1, 1] = 12 * 2 * PAGE  # one past the layer's last row
    with pytest.raises(KernelRefused, match="outside the layer"):
        kernel.step_context(HKV * GROUP, pool, outside, *meta)
    moved = rows.clone()
    bad = kernel.step_context(HKV * GROUP, pool, moved, *meta)
    moved.copy_(outside)  # after the context was made: each C call checks the rows again
    assert call(0, k * 2, v * 2, bad.ctx)[0] == -1
    assert torch.equal(pool, before)
    for args in (
        (HKV * GROUP, pool.half(), rows, *meta),  # float32 or bf16 pools only
        (HKV * GROUP, pool[0], rows, *meta),  # the whole pool, not a layer
        (HKV * GROUP, pool, rows[:, :1].contiguous(), *meta),  # a row per sequence
        (HKV * GROUP + 1, pool, rows, *meta),  # query heads a multiple of the KV heads
    ):
        with pytest.raises(ValueError, match="does not take"):
            kernel.step_context(*args)  # type: ignore[arg-type]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
@pytest.mark.parametrize(
    ("dtype", "pool_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["bf16", "float32", "float32-over-bf16"],
)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_a_nan_in_q_k_or_v_reaches_the_output_as_in_torch(
    where: str,
    build: str,
    dtype: torch.dtype,
    pool_dtype: torch.dtype,
    fresh: Path,
    built_for: Callable[[str], cpu_decode.DecodeKernel],
) -> None:
    """A NaN in one query head, or in one key's or value's head, makes exactly the outputs
    that float attention makes NaN (the SIMD exp once clamped NaN to a finite -87), and no
    other output changes."""
    kernel = _build(build, built_for)
    torch.manual_seed(4)
    layer = torch.randn(8, 2, PAGE, HKV, DIM).to(pool_dtype)
    pages, lens = [[3, 5], [1]], [20, 9]
    q = torch.randn(2, HKV * GROUP, DIM).to(dtype)
    clean = kernel.run(q, layer, *_metadata(pages, lens))
    if where == "q":
        q[0, 4, 7] = float("nan")  # sequence 0, query head 4 (KV head 1)
    else:
        layer[5, 0 if where == "k" else 1, 2, 1, 7] = float("nan")  # sequence 0's key 18, head 1
    got = kernel.run(q, layer, *_metadata(pages, lens))
    want = _reference(q, layer, pages, lens)
    assert torch.equal(got.float().isnan(), want.isnan()) and got.isnan().any()
    assert torch.equal(got[~got.isnan()], clean[~got.isnan()])


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16-pool"])
@pytest.mark.parametrize(("hkv", "group", "dim"), [(3, 3, 64), (2, 4, 128), (1, 8, 80)])
def test_a_chunks_tokens_together_get_the_bits_each_gets_alone(
    hkv: int,
    group: int,
    dim: int,
    pool_dtype: torch.dtype,
    build: str,
    built_for: Callable[[str], cpu_decode.DecodeKernel],
) -> None:
    """A prefill chunk's tokens are rows on the same pages, which the float32 kernel runs
    several to a job (each K and V row read once for all of them): every token's output is
    bit for bit what it gets as the only row of a step, so a token's attention does not
    depend on the chunk around it (batch invariance). A NaN key reaches exactly the tokens
    whose prefix holds it, as a job of its own would have it."""
    kernel = _build(build, built_for)
    torch.manual_seed(7)
    layer = torch.randn(24, 2, PAGE, hkv, dim).to(pool_dtype)
    a, b, c = [9, 2, 17, 5, 11], [3], [20, 0]  # three sequences' pages, out of order
    # A: a 37-token chunk after 33 cached keys; B: one decode row; C: a 21-token chunk from 0
    pages = [a] * 37 + [b] + [c] * 21
    lens = [*range(34, 71), 13, *range(1, 22)]
    q = torch.randn(len(lens), hkv * group, dim)

    def alone(layer: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [kernel.run(q[i : i + 1], layer, *_metadata([pages[i]], [lens[i]])) for i in range(len(lens))]
        )

    together = kernel.run(q, layer, *_metadata(pages, lens))
    assert torch.equal(together, alone(layer))
    for i, (own, n) in enumerate(zip(pages, lens, strict=True)):
        idx = torch.tensor(own)
        k = layer[idx, 0].reshape(-1, hkv, dim)[:n].float()
        v = layer[idx, 1].reshape(-1, hkv, dim)[:n].float()
        qq = q[i].view(hkv, group, dim)
        p = (torch.einsum("hgd,nhd->hgn", qq, k) * dim**-0.5).softmax(-1)
        want = torch.einsum("hgn,nhd->hgd", p, v).reshape(hkv * group, dim)
        torch.testing.assert_close(together[i], want, atol=1e-5, rtol=1e-5)
    # A's key 60 (page 5, slot 12) holds NaNs in K and V: A's tokens with more than 60 keys
    # read them, the others share the block but not the key.
    layer[5, :, 12, 0, 5] = float("nan")
    poisoned = kernel.run(q, layer, *_metadata(pages, lens))
    torch.testing.assert_close(poisoned, alone(layer), rtol=0, atol=0, equal_nan=True)
    reads = torch.tensor([own is a and n > 60 for own, n in zip(pages, lens, strict=True)])
    assert poisoned[reads, :group].isnan().all() and not poisoned[~reads].isnan().any()
    assert torch.equal(poisoned[~reads], together[~reads])
