"""A paged decode-attention kernel for bf16 (and float32) KV on CPU, compiled on first use.

torch has no paged attention on CPU, so the torch backend gathers each decode row's K/V out
of the pool before two batched matmuls: the gather writes a copy as large as what it reads,
and the matmuls read it again. ``cpu_decode.c`` reads the pages in place instead (float32
math, online softmax over one page at a time, OpenMP over sequence x KV head).
NOTE: measured on 2 cores, SmolLM2-135M (30 layers, 3 KV heads of 64), one thread: a decode
step of 9 rows at 1,050 keys spent 56 ms in index_select and 42 ms in bmm out of ~195 ms.

The kernel is built and cached by :mod:`kvcache.native_build` (a private, owner-only cache;
a damaged entry is rebuilt, a foreign one never loaded) and loaded with ctypes, which
releases the GIL for the call. Without a compiler, or with ``KVFENCE_CPU_KERNEL=off``,
:func:`kernel` answers None and the torch path runs. Loading it after torch makes its OpenMP
calls resolve to the libgomp torch loaded, so it uses the calling thread's worker pool.

The C code is a trust boundary: every entry point checks the step plan it is given (each
page index inside the layer's ``num_pages``, ``indptr`` from 0 and non-decreasing within the
page list, each length within its pages, each written row on a page of its own sequence)
before it reads or writes KV memory, and answers a status the wrappers here raise as
:class:`~kvcache.errors.KernelRefused`. The wrappers check what C cannot see (dtypes, shapes,
strides, devices). The plan comes from the fenced step, so a refusal is a bug upstream; the
checks keep it from becoming a read of another sequence's pages.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvcache.attention import NativeAttend
from kvcache.errors import KernelRefused
from kvcache.native_build import load_once

SOURCE = Path(__file__).with_name("cpu_decode.c")  # the kernel's C source
_lock = threading.Lock()
_loaded: dict[str, DecodeKernel | None] = {}

# The C code's KVF_ statuses (cpu_decode.c, "Boundary checks").
_REFUSALS = {
    -1: "a KV row outside the layer; nothing was written",
    -2: "page spans (indptr) that do not start at 0, decrease, or run past the page list",
    -3: "a page index outside the pool",
    -4: "a sequence length below 0 or past its pages",
    -5: "a KV row outside its own sequence's pages; nothing was written",
    -6: "a batch, head, dimension or page size the CPU decode kernel does not take",
    -7: "a logit softcap below 0 or not finite",
}


def refused(status: int) -> KernelRefused:
    """The error for a C status other than 0."""
    return KernelRefused(_REFUSALS.get(status, f"the CPU decode kernel refused its input ({status})"))


def _on_cpu(*tensors: torch.Tensor) -> bool:
    # NOTE: ``is_cpu``, not ``device.type``: measured ~70 ns against ~6 us a tensor here.
    return all(t.is_cpu for t in tensors)


class DecodeKernel:
    """The loaded kernel. The wrappers check dtypes, shapes, strides and devices; the C code
    checks the step plan and rows; either refusal raises :class:`KernelRefused`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvf_decode_bf16
        self._fn.restype = ctypes.c_int
        # (q, kv, indptr, indices, lens, out, batch, hq, hkv, dim, page_size, scale,
        #  n_indices, num_pages, window, softcap)
        self._fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 5 + [ctypes.c_float]
        self._fn.argtypes += [ctypes.c_int64] * 2
        self._fn.argtypes += [ctypes.c_int, ctypes.c_float]
        self._fn32 = lib.kvf_decode_f32
        self._fn32.restype = ctypes.c_int
        self._fn32.argtypes = self._fn.argtypes
        # float32 q and out over a bf16 pool (float32 compute with KV stored in bf16)
        self._fn_bf16kv = lib.kvf_decode_f32_bf16kv
        self._fn_bf16kv.restype = ctypes.c_int
        self._fn_bf16kv.argtypes = self._fn.argtypes
        fused_args: list[Any] = (
            [ctypes.c_void_p] * 5
            + [ctypes.c_int64]
            + [ctypes.c_void_p] * 4
            + [ctypes.c_int] * 5
            + [ctypes.c_float, ctypes.c_int64]
            + [ctypes.c_int, ctypes.c_float]
        )
        # by (q, k, v and out dtype, pool dtype)
        self._fused: dict[tuple[torch.dtype, torch.dtype], Callable[..., int]] = {
            (torch.bfloat16, torch.bfloat16): lib.kvf_write_decode_bf16,
            (torch.float32, torch.float32): lib.kvf_write_decode_f32,
            (torch.float32, torch.bfloat16): lib.kvf_write_decode_f32_bf16kv,
        }
        for name in ("kvf_write_decode_bf16", "kvf_write_decode_f32", "kvf_write_decode_f32_bf16kv"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = fused_args
        self._check = lib.kvf_check_step
        self._check.restype = ctypes.c_int
        self._check.argtypes = fused_args[4:9] + fused_args[10:15] + fused_args[16:17]
        attend = ctypes.cast(lib.kvf_step_attend_f32, ctypes.c_void_p).value
        assert attend is not None
        self._step_attend: int = attend  # an address, called by native model code only
        group, dim, page = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        lib.kvf_limits(ctypes.byref(group), ctypes.byref(dim), ctypes.byref(page))
        self.max_group, self.max_dim, self.max_page = group.value, dim.value, page.value

    def supports(self, q_heads: int, kv_layer: torch.Tensor) -> bool:
        """Whether a layer of this shape and dtype can run here."""
        _, two, page_size, hkv, dim = kv_layer.shape
        return (
            kv_layer.dtype in (torch.bfloat16, torch.float32)
            and kv_layer.is_cpu
            and kv_layer.is_contiguous()
            and two == 2
            and q_heads % hkv == 0
            and q_heads // hkv <= self.max_group
            and dim <= self.max_dim
            and page_size <= self.max_page
        )

    def run(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        lens: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of ``q`` ``[B, Hq, D]`` (one token per sequence) over each sequence's
        first ``lens[b]`` keys on pages ``indices[indptr[b]:indptr[b + 1]]`` (the last
        ``window`` of them where ``window`` > 0; each scaled score ``s`` taken as
        ``softcap * tanh(s / softcap)`` where ``softcap`` > 0). ``q`` has the pool's dtype, or is float32
        over a bf16 pool (the output is ``q``'s dtype). Raises :class:`KernelRefused` for
        anything the kernel does not take, nothing read."""
        try:
            batch, hq, dim = q.shape
            pages, _, page_size, hkv, kv_dim = kv_layer.shape
        except ValueError:  # another number of dimensions
            raise KernelRefused("shape or dtype the CPU decode kernel does not take") from None
        if (
            not self.supports(hq, kv_layer)
            or kv_dim != dim
            or (q.dtype, kv_layer.dtype) not in self._fused
            or not (q.is_cpu and indptr.is_cpu and indices.is_cpu and lens.is_cpu)
        ):
            raise KernelRefused("shape or dtype the CPU decode kernel does not take")
        for t in (indptr, indices, lens):  # read as flat arrays: any contiguous shape will do
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise KernelRefused("page metadata must be contiguous int32")
        if indptr.numel() != batch + 1 or lens.numel() != batch:
            raise KernelRefused("one indptr span and one length per sequence")
        q = q.contiguous()
        out = torch.empty_like(q)
        if q.dtype == kv_layer.dtype:
            fn = self._fn32 if q.dtype == torch.float32 else self._fn
        else:
            fn = self._fn_bf16kv
        status = fn(
            q.data_ptr(),
            kv_layer.data_ptr(),
            indptr.data_ptr(),
            indices.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            batch,
            hq,
            hkv,
            dim,
            page_size,
            dim**-0.5,
            indices.numel(),
            pages,
            window,
            softcap,
        )
        if status != 0:
            raise refused(status)
        return out

    def write_run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        rows: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        lens: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Store ``k``/``v`` ``[B, Hkv, D]`` at ``rows`` ``[2, B]`` (K rows, then V rows, as
        :func:`kvcache.metadata.kv_rows` computes them) of layer ``layer`` of the pool tensor
        ``kv`` ``[L, pages, 2, page_size, Hkv, D]``, then :meth:`run` on that layer, in one C
        call (the compiled step's per-layer work; a Python write and call cost ~30 us a layer).
        The C call checks the plan and every row (nothing written on a refusal), so the
        plan is not checked a second time here. The metadata's dtypes and sizes are
        :meth:`run`'s; the graph that calls this fixed them."""
        if kv.dim() != 6 or not 0 <= layer < kv.shape[0]:
            raise KernelRefused("shape or dtype the CPU decode kernel does not take")
        q, k, v, kv_layer = q.contiguous(), k.contiguous(), v.contiguous(), kv[layer]
        writer = self._layer_writer(q, k, v, kv_layer, (rows, indptr, indices, lens), False)
        return writer(q, k, v, kv_layer, window, softcap)

    def layer_writer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        rows: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        lens: torch.Tensor,
    ) -> LayerWriter:
        """:meth:`write_run` for an eager all-decode step, one layer's
        ``[pages, 2, page_size, Hkv, D]`` view at a time: the step's tensors are checked here,
        once, with the first layer's; each call of the answer checks that its own ``q``,
        ``k``, ``v`` and layer have the same shapes, dtype and layout (nothing else can change
        between layers) and runs the C call, whose rows check stays on every call.
        NOTE: measured on a 2-core AVX2 EPYC: the full checks cost ~15 us a call, 30 times
        a step."""
        return self._layer_writer(q, k, v, kv_layer, (rows, indptr, indices, lens), True)

    def _layer_writer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        early: bool,
    ) -> LayerWriter:
        """:meth:`layer_writer`; with ``early`` the plan's C check also runs here, once."""
        rows, indptr, indices, lens = metadata
        batch, hq, q_dim = q.shape
        fused = self._checked_step(batch, hq, kv_layer, rows, indptr, indices, lens, q.dtype, early)
        _, _, _, hkv, dim = kv_layer.shape
        if (
            k.dtype != q.dtype
            or v.dtype != q.dtype
            or q_dim != dim
            or k.shape != (batch, hkv, dim)
            or v.shape != (batch, hkv, dim)
            or not _on_cpu(q, k, v)
        ):
            raise KernelRefused("shape or dtype the CPU decode kernel does not take")
        return LayerWriter(fused, q, k, kv_layer, (rows, indptr, indices, lens))

    def _checked_step(
        self,
        batch: int,
        q_heads: int,
        kv_layer: torch.Tensor,
        rows: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        lens: torch.Tensor,
        dtype: torch.dtype,
        early: bool = True,
    ) -> Callable[..., int]:
        """The fused C call for q, k, v of ``dtype`` and ``kv_layer``'s dtype, after checking
        one step's layer view and metadata, and with ``early`` (in C, ``kvf_check_step``) its
        plan and rows: each C call checks them again, so this raises early what a call would
        refuse."""
        fused = self._fused.get((dtype, kv_layer.dtype))
        if (
            fused is None
            or kv_layer.dim() != 5
            or not kv_layer.is_contiguous()
            or not self.supports(q_heads, kv_layer)
            or rows.dtype != torch.int64
            or rows.shape != (2, batch)
            or not rows.is_contiguous()
            or indptr.numel() != batch + 1
            or lens.numel() != batch
            or not _on_cpu(rows, indptr, indices, lens)
        ):
            raise KernelRefused("shape or dtype the CPU decode kernel does not take")
        for t in (indptr, indices, lens):
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise KernelRefused("page metadata must be contiguous int32")
        if not early:
            return fused
        pages, two, page_size, hkv, dim = kv_layer.shape
        status = self._check(
            rows.data_ptr(), pages * two * page_size, indptr.data_ptr(), indices.data_ptr(),
            lens.data_ptr(), batch, q_heads, hkv, dim, page_size, indices.numel(),
        )
        if status != 0:
            raise refused(status)
        return fused

    def step_context(
        self,
        q_heads: int,
        kv: torch.Tensor,
        rows: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        lens: torch.Tensor,
        windows: torch.Tensor | None = None,
        softcaps: torch.Tensor | None = None,
    ) -> NativeAttend:
        """A float32 all-decode step's attention as a C function and context for native
        model code (:class:`kvcache.attention.NativeAttend`): the pool ``kv``
        ``[L, pages, 2, page_size, Hkv, D]`` and the step's metadata are checked here, once;
        each layer's C call checks its layer index and every row it writes. ``windows``
        ``[L]`` int32: each layer's window (0 or None: every key); ``softcaps`` ``[L]``
        float32: each layer's logit softcap (0 or None: none)."""
        if (
            kv.dim() != 6
            or kv.dtype not in (torch.float32, torch.bfloat16)
            or kv.shape[0] < 1
            or not kv.is_contiguous()  # the C code steps from layer to layer by one size
        ):
            raise KernelRefused("a pool the CPU decode kernel does not take")
        if windows is not None and (
            windows.dtype != torch.int32
            or windows.shape != (kv.shape[0],)
            or not windows.is_contiguous()
        ):
            raise KernelRefused("one int32 window per layer")
        if softcaps is not None and (
            softcaps.dtype != torch.float32
            or softcaps.shape != (kv.shape[0],)
            or not softcaps.is_contiguous()
        ):
            raise KernelRefused("one float32 softcap per layer")
        batch = lens.numel()
        self._checked_step(batch, q_heads, kv[0], rows, indptr, indices, lens, torch.float32)
        layers, pages, two, page_size, hkv, dim = kv.shape
        ctx = _StepContext(
            kv.data_ptr(), kv[0].numel(), pages * two * page_size, rows.data_ptr(),
            indptr.data_ptr(), indices.data_ptr(), lens.data_ptr(), layers, batch, q_heads,
            hkv, dim, page_size, dim**-0.5, int(kv.dtype == torch.bfloat16), indices.numel(),
            None if windows is None else windows.data_ptr(),
            None if softcaps is None else softcaps.data_ptr(),
        )
        return NativeAttend(
            fn=self._step_attend, ctx=ctypes.addressof(ctx), batch=batch, q_heads=q_heads,
            kv_heads=hkv, head_dim=dim, num_layers=layers,
            keep=(ctx, kv, rows, indptr, indices, lens, windows, softcaps),
        )


class _StepContext(ctypes.Structure):
    """``kvf_step_ctx`` in cpu_decode.c."""

    _fields_ = [
        ("kv", ctypes.c_void_p),
        ("layer_elems", ctypes.c_int64),
        ("layer_rows", ctypes.c_int64),
        ("rows", ctypes.c_void_p),
        ("indptr", ctypes.c_void_p),
        ("indices", ctypes.c_void_p),
        ("lens", ctypes.c_void_p),
        ("layers", ctypes.c_int32),
        ("batch", ctypes.c_int32),
        ("hq", ctypes.c_int32),
        ("hkv", ctypes.c_int32),
        ("dim", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("kv16", ctypes.c_int32),
        ("n_indices", ctypes.c_int64),
        ("windows", ctypes.c_void_p),
        ("softcaps", ctypes.c_void_p),
    ]


class LayerWriter:
    """One layer's K/V write and attention for a step :meth:`DecodeKernel.layer_writer`
    checked: ``(q, k, v, kv_layer) -> out``, each call checking only what can differ
    between layers (the tensors' shapes, dtype and layout) against the checked first layer."""

    __slots__ = ("_args", "_dtype", "_fn", "_kv", "_layer", "_metadata", "_pool_dtype", "_q")

    def __init__(
        self,
        fn: Callable[..., int],
        q: torch.Tensor,
        k: torch.Tensor,
        kv_layer: torch.Tensor,
        metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        self._fn = fn
        self._dtype, self._pool_dtype = q.dtype, kv_layer.dtype
        self._q, self._kv, self._layer = q.shape, k.shape, kv_layer.shape
        self._metadata = metadata  # rows, indptr, indices, lens: kept alive for the pointers
        rows, indptr, indices, lens = (t.data_ptr() for t in metadata)
        batch, hq, dim = q.shape
        pages, two, page_size, hkv, _ = kv_layer.shape
        self._args = (
            rows, pages * two * page_size, indptr, indices, lens, batch, hq, hkv, dim,
            page_size, dim**-0.5, metadata[2].numel(),
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """``window`` > 0: each row attends over its sequence's last ``window`` keys;
        ``softcap`` > 0: scores capped as :meth:`DecodeKernel.run` caps them."""
        if not (
            q.shape == self._q
            and k.shape == self._kv
            and v.shape == self._kv
            and kv_layer.shape == self._layer
            and q.dtype == k.dtype == v.dtype == self._dtype
            and kv_layer.dtype == self._pool_dtype
            and q.is_contiguous()
            and k.is_contiguous()
            and v.is_contiguous()
            and kv_layer.is_contiguous()
            and q.is_cpu
            and k.is_cpu
            and v.is_cpu
            and kv_layer.is_cpu
        ):
            raise KernelRefused("shape or dtype the CPU decode kernel does not take")
        out = torch.empty_like(q)
        rows, layer_rows, indptr, indices, lens, batch, hq, hkv, dim, page, scale, nnz = self._args
        status = self._fn(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), kv_layer.data_ptr(), rows, layer_rows,
            indptr, indices, lens, out.data_ptr(), batch, hq, hkv, dim, page, scale, nnz, window,
            softcap,
        )
        if status != 0:
            raise refused(status)
        return out


def kernel() -> DecodeKernel | None:
    """The compiled kernel, built once per process (and cached on disk); None where it
    cannot be built or is switched off."""
    return load_once(_loaded, _lock, SOURCE, "cpu_decode", DecodeKernel)
