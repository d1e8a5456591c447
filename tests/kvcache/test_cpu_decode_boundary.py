"""The C decode kernel as a trust boundary: every page index, span, length, written row,
shape, stride, dtype and device it is given is checked once per call (the value checks in C,
against the pool's page count), and a bad call raises KernelRefused with nothing read or
written."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from kvcache.backends import cpu_decode
from kvcache.errors import KernelRefused, KVCacheError
from kvcache.metadata import kv_rows

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

PAGE, HKV, GROUP, DIM, PAGES = 16, 3, 3, 64, 12
DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
]
IDS = ["bf16", "float32", "float32-over-bf16"]


def _kernel() -> cpu_decode.DecodeKernel:
    kernel = cpu_decode.kernel()
    assert kernel is not None, "a C compiler is here: the kernel must build"
    return kernel


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _step(dtype: torch.dtype, pool_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A two-layer pool (layer 1 is the one attended), q, k, v, and a valid plan: sequence 0
    on pages 4, 9 with 20 keys, sequence 1 on page 2 with 7 keys."""
    torch.manual_seed(0)
    pool = torch.randn(2, PAGES, 2, PAGE, HKV, DIM).to(pool_dtype)
    q = torch.randn(2, HKV * GROUP, DIM).to(dtype)
    k, v = (torch.randn(2, HKV, DIM).to(dtype) for _ in range(2))
    return pool, q, k, v, _i32(0, 2, 3), _i32(4, 9, 2), _i32(20, 7)


BAD_PLANS = {
    # name: (indptr, indices, lens, the refusal)
    "one page past the layer": ((0, 2, 3), (4, PAGES, 2), (20, 7), "page index outside the pool"),
    "a negative page": ((0, 2, 3), (4, -1, 2), (20, 7), "page index outside the pool"),
    "a page at 2**30": ((0, 2, 3), (4, 2**30, 2), (20, 7), "page index outside the pool"),
    "spans not from 0": ((1, 2, 3), (4, 9, 2), (20, 7), "spans"),
    "decreasing spans": ((0, 2, 1), (4, 9, 2), (20, 7), "spans"),
    "spans past the page list": ((0, 2, 40), (4, 9, 2), (20, 7), "spans"),
    "a length past its pages": ((0, 2, 3), (4, 9, 2), (20, PAGE + 1), "length"),
    "a negative length": ((0, 2, 3), (4, 9, 2), (-1, 7), "length"),
}


@pytest.mark.parametrize(("dtype", "pool_dtype"), DTYPES, ids=IDS)
@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_a_bad_plan_is_refused_by_the_kernel_and_the_fused_write(
    case: str, dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    """Each bad plan (the attacks that read another layer's page, segfaulted, or silently cut
    a length) is refused by ``run``, ``write_run``, ``layer_writer`` and ``step_context``,
    and the fused write stores nothing."""
    kernel = _kernel()
    pool, q, k, v, *_ = _step(dtype, pool_dtype)
    indptr, indices, lens, refusal = BAD_PLANS[case]
    plan = (_i32(*indptr), _i32(*indices), _i32(*lens))
    rows = kv_rows(torch.tensor([9 * PAGE + 3, 2 * PAGE + 6]), PAGE)
    before = pool.clone()
    with pytest.raises(KernelRefused, match=refusal):
        kernel.run(q, pool[1], *plan)
    with pytest.raises(KernelRefused, match=refusal):
        kernel.write_run(q, k, v, pool, 1, rows, *plan)
    with pytest.raises(KernelRefused, match=refusal):
        kernel.layer_writer(q, k, v, pool[1], rows, *plan)
    if dtype == torch.float32:
        with pytest.raises(KernelRefused, match=refusal):
            kernel.step_context(HKV * GROUP, pool, rows, *plan)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_the_c_entry_point_checks_the_plan_itself(case: str) -> None:
    """The C function refuses a bad plan by itself (status, nothing read), so a caller that
    skipped the wrapper's checks still cannot read outside the pool."""
    kernel = _kernel()
    pool, q, *_ = _step(torch.float32, torch.float32)
    indptr, indices, lens, _ = BAD_PLANS[case]
    plan = (_i32(*indptr), _i32(*indices), _i32(*lens))
    out = torch.full_like(q, 7.0)
    status = kernel._fn32(
        q.data_ptr(), pool[1].data_ptr(), *(t.data_ptr() for t in plan), out.data_ptr(),
        2, HKV * GROUP, HKV, DIM, PAGE, DIM**-0.5, plan[1].numel(), PAGES, 0, 0.0,
    )
    codes = {"page index outside the pool": -3, "spans": -2, "length": -4}
    assert status == codes[BAD_PLANS[case][3]] and (out == 7.0).all()
    good = _step(torch.float32, torch.float32)[4:]
    status = kernel._fn32(
        q.data_ptr(), pool[1].data_ptr(), *(t.data_ptr() for t in good), out.data_ptr(),
        2, HKV * GROUP, HKV, DIM, PAGE, DIM**-0.5, good[1].numel(), PAGES, 0, 0.0,
    )
    assert status == 0 and not (out == 7.0).any()


def test_the_c_entry_point_refuses_a_bad_softcap_itself() -> None:
    """A logit softcap below 0 or not finite is refused by the C function (status -7,
    nothing read) before any job runs; 0 (no cap) and a positive cap attend."""
    kernel = _kernel()
    pool, q, *_ = _step(torch.float32, torch.float32)
    good = _step(torch.float32, torch.float32)[4:]
    for cap, want in ((-1.0, -7), (float("nan"), -7), (float("inf"), -7), (0.0, 0), (3.0, 0)):
        out = torch.full_like(q, 7.0)
        status = kernel._fn32(
            q.data_ptr(), pool[1].data_ptr(), *(t.data_ptr() for t in good), out.data_ptr(),
            2, HKV * GROUP, HKV, DIM, PAGE, DIM**-0.5, good[1].numel(), PAGES, 0, cap,
        )
        assert status == want and bool((out == 7.0).all()) == (want != 0), cap


def test_a_page_index_outside_the_pool_is_refused() -> None:
    """One past the layer read the next layer's page (another tenant's KV in a real pool)
    before the kernel knew how many pages a layer has."""
    kernel = _kernel()
    pool, q, *_ = _step(torch.float32, torch.float32)
    with pytest.raises(KernelRefused, match="page index outside the pool"):
        kernel.run(q, pool[0], _i32(0, 2, 3), _i32(4, PAGES, 2), _i32(20, 7))
    # the same pages named inside the layer attend normally
    assert kernel.run(q, pool[0], _i32(0, 2, 3), _i32(4, PAGES - 1, 2), _i32(20, 7)).isfinite().all()


@pytest.mark.parametrize(("dtype", "pool_dtype"), DTYPES, ids=IDS)
def test_the_writer_stores_only_on_its_own_sequences_pages(
    dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    """A row inside the layer but on another sequence's page, or a K row in a V half, or K
    and V rows of different slots, is refused with nothing written; the plan's own slots
    (any of the sequence's pages) are written."""
    kernel = _kernel()
    pool, q, k, v, *plan = _step(dtype, pool_dtype)
    before = pool.clone()
    for slots, tweak in (
        ((9 * PAGE + 3, 4 * PAGE + 6), None),  # sequence 1 writing on sequence 0's page 4
        ((11 * PAGE, 2 * PAGE + 6), None),  # sequence 0 writing on nobody's page 11
        ((9 * PAGE + 3, 2 * PAGE + 6), "k in v"),
        ((9 * PAGE + 3, 2 * PAGE + 6), "v elsewhere"),
    ):
        rows = kv_rows(torch.tensor(slots), PAGE)
        if tweak == "k in v":
            rows[0, 1] += PAGE
            rows[1, 1] += PAGE
        elif tweak == "v elsewhere":
            rows[1, 0] += 1
        with pytest.raises(KernelRefused, match="own sequence's pages; nothing was written"):
            kernel.write_run(q, k, v, pool, 1, rows, *plan)
        assert torch.equal(pool, before)
    own = kv_rows(torch.tensor([4 * PAGE + 1, 2 * PAGE + 6]), PAGE)  # an earlier page of its own
    kernel.write_run(q, k, v, pool, 1, own, *plan)
    assert not torch.equal(pool[1], before[1]) and torch.equal(pool[0], before[0])


def test_a_refusal_is_a_typed_kvcache_error() -> None:
    err = cpu_decode.refused(-3)
    assert isinstance(err, KVCacheError) and isinstance(err, ValueError)
    assert "page index outside the pool" in str(err)


def test_shapes_strides_dtypes_and_devices_are_checked_before_the_call() -> None:
    kernel = _kernel()
    pool, q, _, _, *plan = _step(torch.float32, torch.float32)
    layer = pool[1]
    strided = torch.randn(2 * PAGES, 2, PAGE, HKV, DIM)[::2]  # gaps between its pages
    for args, refusal in (
        ((q[0], layer, *plan), "does not take"),  # q without its batch dimension
        ((q, strided, *plan), "does not take"),
        ((q, layer.to("meta"), *plan), "does not take"),
        ((q, layer, plan[0].to("meta"), plan[1], plan[2]), "does not take"),
        ((q, layer, plan[0], plan[1].long(), plan[2]), "int32"),
        ((q, layer, plan[0], torch.stack([plan[1], plan[1]], 1)[:, 0], plan[2]), "int32"),
        ((q.double(), layer, *plan), "does not take"),
    ):
        with pytest.raises(KernelRefused, match=refusal):
            kernel.run(*args)


def test_step_context_refuses_a_pool_whose_layers_are_not_contiguous() -> None:
    """The C code steps from one layer to the next by one layer's size, so a pool view with
    gaps between layers (or pages) would be written outside: refused when made."""
    kernel = _kernel()
    pool, q, k, v, *plan = _step(torch.float32, torch.float32)
    rows = kv_rows(torch.tensor([9 * PAGE + 3, 2 * PAGE + 6]), PAGE)
    wide = torch.zeros(2, 2 * PAGES, 2, PAGE, HKV, DIM)
    for bad in (wide[:, ::2], wide[:, :PAGES], pool.transpose(1, 2).contiguous().transpose(1, 2)):
        assert bad.shape == pool.shape and not bad.is_contiguous()
        with pytest.raises(KernelRefused, match="pool"):
            kernel.step_context(HKV * GROUP, bad, rows, *plan)
    assert not wide.any()
    native = kernel.step_context(HKV * GROUP, pool, rows, *plan)
    attend = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 4)(
        native.fn
    )
    out = torch.empty_like(q)
    assert attend(native.ctx, 1, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()) == 0
