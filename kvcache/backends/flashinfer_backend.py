"""Paged attention with FlashInfer (CUDA only; ``flashinfer`` is imported lazily here).

One ``BatchDecodeWithPagedKVCacheWrapper`` for the one-token rows and one
``BatchPrefillWithPagedKVCacheWrapper`` (causal) for the prefill chunks. The pool's per-layer
``[num_pages, 2, page_size, H, D]`` view is FlashInfer's NHD paged-KV tensor as is.

A step is planned in :meth:`FlashInferBackend.prepare`, which only ``begin_step`` calls, after
the fence has passed: no page reaches a plan (or a kernel) unchecked, and no plan runs inside
a model forward (so none can end up inside a captured CUDA graph). The plan is reused by
every layer.

Checked against flashinfer-python 0.6.x ``plan``/``run``: the four CSR arrays and
``num_qo_heads, num_kv_heads, head_dim, page_size`` positionally, every option by keyword
(later positional options are deprecated); ``plan`` copies the CSR arrays to the device and
reads ``indptr``/``last_page_len`` on the host, so they are built on the host here (a device
copy would cost a device-to-host sync per plan).

:class:`FlashInferGraphDecode` is the CUDA-graph flavour of the decode wrapper: fixed batch
size, CSR arrays in static buffers that ``plan`` refills before each replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.metadata import AttentionMetadata

_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class HeadShape:
    """What a plan needs besides the CSR arrays: the model's heads and the pool's dtype."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size) < 1:
            raise ValueError(f"every size must be >= 1: {self}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")


@dataclass(frozen=True, slots=True)
class Csr:
    """FlashInfer's paged-KV CSR for a subset of a step's sequences.

    ``qo_indptr``, ``kv_indptr`` and ``kv_last_page_len`` live on the host (``plan`` reads
    them there); ``kv_indices`` lives on the device.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def csr(meta: AttentionMetadata, which: Sequence[int], device: torch.device) -> Csr:
    """The CSR of sequences ``which`` (batch positions), from the metadata's host copies."""
    qo, kv = [0], [0]
    idx: list[int] = []
    last: list[int] = []
    for i in which:
        pages = meta.page_ids[i]
        qo.append(qo[-1] + meta.qo_lens[i])
        kv.append(kv[-1] + len(pages))
        idx.extend(pages)
        last.append(meta.kv_lens[i] - (len(pages) - 1) * meta.page_size)

    def host(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32)

    return Csr(host(qo), host(kv), host(idx).to(device), host(last))


def query_rows(meta: AttentionMetadata, which: Sequence[int]) -> list[int]:
    """Rows of the step's flattened query that belong to sequences ``which``."""
    offsets = [0]
    for n in meta.qo_lens:
        offsets.append(offsets[-1] + n)
    return [r for i in which for r in range(offsets[i], offsets[i + 1])]


def _plan_options(shape: HeadShape, window: int, softcap: float = 0.0) -> dict[str, Any]:
    options: dict[str, Any] = {
        "pos_encoding_mode": "NONE",  # RoPE is applied by the model before attention
        "q_data_type": shape.dtype,
        "kv_data_type": shape.dtype,
        "sm_scale": shape.head_dim**-0.5,
        # FlashInfer's query at position p reads keys p - window_left .. p; -1 reads all.
        "window_left": window - 1 if window > 0 else -1,
    }
    if softcap > 0:
        # FlashInfer's logits_soft_cap: each scaled score s becomes cap * tanh(s / cap).
        options["logits_soft_cap"] = softcap
    return options


class FlashInferStep:
    """A planned step; see :class:`~kvcache.backends.base.StepKernel`."""

    def __init__(self, backend: FlashInferBackend, metadata: AttentionMetadata) -> None:
        self._backend = backend
        shape = backend.shape
        if metadata.page_size != shape.page_size:
            raise ValueError(f"step page_size {metadata.page_size} != {shape.page_size}")
        device = backend.device
        decode = [i for i, n in enumerate(metadata.qo_lens) if n == 1]
        prefill = [i for i, n in enumerate(metadata.qo_lens) if n != 1]
        heads = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.page_size)
        dec_csr = csr(metadata, decode, device) if decode else None
        pre_csr = csr(metadata, prefill, device) if prefill else None
        # One plan per distinct (window, softcap) of the pool's layers (a plan fixes
        # window_left and logits_soft_cap), each on its own pair of wrappers; layers with the
        # same pair share it.
        layers = max(len(metadata.windows), len(metadata.softcaps), 1)
        windows = metadata.windows or (0,) * layers
        caps = metadata.softcaps or (0.0,) * layers
        self._pairs: dict[tuple[int, float], tuple[Any, Any]] = {}
        for window, softcap in sorted(set(zip(windows, caps, strict=True))):
            dec, pre = self._pairs[window, softcap] = backend.wrappers(window, softcap)
            opts = _plan_options(shape, window, softcap)
            if dec_csr is not None:
                c = dec_csr
                dec.plan(c.kv_indptr, c.kv_indices, c.kv_last_page_len, *heads, **opts)
            if pre_csr is not None:
                c = pre_csr
                pre.plan(
                    c.qo_indptr,
                    c.kv_indptr,
                    c.kv_indices,
                    c.kv_last_page_len,
                    *heads,
                    causal=True,
                    **opts,
                )
        # 0: decode wrapper only, 1: prefill only, None: both on their own rows
        self._only: int | None = None
        if not prefill:
            self._only = 0
        elif not decode:
            self._only = 1
        else:
            # NOTE: mixed steps run the two wrappers on their own rows; the rows are gathered
            # with index tensors built once here, not per layer.
            rows = query_rows(metadata, decode), query_rows(metadata, prefill)
            self._decode_rows = torch.tensor(rows[0], dtype=torch.long, device=device)
            self._prefill_rows = torch.tensor(rows[1], dtype=torch.long, device=device)

    def __call__(
        self, q: torch.Tensor, kv_layer: torch.Tensor, window: int = 0, softcap: float = 0.0
    ) -> torch.Tensor:
        pair = self._pairs[window, softcap]
        qx = q.to(kv_layer.dtype)
        if self._only is not None:
            return pair[self._only].run(qx, kv_layer).to(q.dtype)  # type: ignore[no-any-return]
        out = torch.empty_like(qx)
        dec = pair[0].run(qx.index_select(0, self._decode_rows), kv_layer)
        pre = pair[1].run(qx.index_select(0, self._prefill_rows), kv_layer)
        out.index_copy_(0, self._decode_rows, dec)
        out.index_copy_(0, self._prefill_rows, pre)
        return out.to(q.dtype)


WrapperFactory = Callable[[str], Any]


class FlashInferBackend:
    """Holds the two wrappers and their workspaces; reused across steps.

    ``wrappers`` builds a wrapper by kind (``"decode"`` or ``"prefill"``); the default
    builds FlashInfer's own on CUDA (:func:`flashinfer_wrappers`). Tests on CPU pass a
    reference implementation of the same plan/run contract.
    """

    def __init__(
        self,
        shape: HeadShape,
        device: torch.device | str = "cuda",
        wrappers: WrapperFactory | None = None,
    ) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self._make = wrappers if wrappers is not None else flashinfer_wrappers(self.device)
        # NOTE: separate workspaces: in a mixed step both wrappers are planned before either runs.
        self.decode: Any = self._make("decode")
        self.prefill: Any = self._make("prefill")
        # Pairs for sliding-window or softcapped layers, by (window, softcap): made on the
        # first step that needs one.
        self._windowed: dict[tuple[int, float], tuple[Any, Any]] = {}

    def wrappers(self, window: int, softcap: float = 0.0) -> tuple[Any, Any]:
        """The (decode, prefill) wrappers planned for layers with ``window`` (0: full
        attention) and ``softcap`` (0: none); the pair above for plain layers."""
        if window == 0 and softcap == 0:
            return self.decode, self.prefill
        pair = self._windowed.get((window, softcap))
        if pair is None:
            pair = (self._make("decode"), self._make("prefill"))
            self._windowed[window, softcap] = pair
        return pair

    def prepare(self, metadata: AttentionMetadata) -> FlashInferStep:
        return FlashInferStep(self, metadata)


def _workspace(device: torch.device) -> torch.Tensor:
    # NOTE: FlashInfer asks for a zeroed float workspace on first use.
    return torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def flashinfer_wrappers(device: torch.device) -> WrapperFactory:
    """A factory of FlashInfer's own NHD wrappers on ``device`` (CUDA only)."""
    if device.type != "cuda":
        raise ValueError("the flashinfer backend needs a CUDA device")
    import flashinfer  # NOTE: lazy, so kvcache imports without CUDA or flashinfer.

    def make(kind: str) -> Any:
        if kind == "decode":
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD")
        if kind == "prefill":
            # NOTE: "fa2", not "auto": on Hopper "auto" picks FA3, whose JIT build takes
            # minutes on a fresh machine; prefill speed is not what decode serving waits on.
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                _workspace(device), "NHD", backend="fa2"
            )
        raise ValueError(f"unknown wrapper kind {kind!r}")

    return make


class FlashInferGraphDecode:
    """Decode attention for one fixed batch size, safe to capture in a CUDA graph.

    :meth:`update` (outside the graph, after the fence) plans a padded decode batch into the
    wrapper's static CSR buffers; :meth:`__call__` (inside the graph) only runs the kernel.
    Implements :class:`~kvcache.graph_step.GraphDecodeKernel`.
    """

    def __init__(
        self, shape: HeadShape, batch_size: int, max_pages: int, device: torch.device
    ) -> None:
        if device.type != "cuda":
            raise ValueError("CUDA-graph decode needs a CUDA device")
        import flashinfer  # NOTE: lazy, as above.

        self.shape = shape
        self.batch_size = batch_size
        self.max_pages = max_pages
        self._device = device

        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self._wrapper: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(device),
            "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=i32(batch_size + 1),
            paged_kv_indices_buffer=i32(max_pages),
            paged_kv_last_page_len_buffer=i32(batch_size),
        )

    def update(self, meta: AttentionMetadata) -> None:
        """Plan ``meta`` (already padded to ``batch_size`` decode rows)."""
        if meta.batch_size != self.batch_size or any(n != 1 for n in meta.qo_lens):
            raise ValueError(f"expected {self.batch_size} decode rows")
        c = csr(meta, range(meta.batch_size), self._device)
        if c.kv_indices.numel() > self.max_pages:
            raise ValueError(f"{c.kv_indices.numel()} pages > graph capacity {self.max_pages}")
        s = self.shape
        self._wrapper.plan(
            c.kv_indptr,
            c.kv_indices,
            c.kv_last_page_len,
            s.num_qo_heads,
            s.num_kv_heads,
            s.head_dim,
            s.page_size,
            **_plan_options(s, 0),  # graphs never serve a windowed pool (GraphDecodeAttention)
        )

    def __call__(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q.to(kv_layer.dtype), kv_layer).to(q.dtype)  # type: ignore[no-any-return]
