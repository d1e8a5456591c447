"""StepAttention: the AttentionFn the model calls for one fenced, planned step."""

from __future__ import annotations

import torch

from kvcache.attention import NativeAttend
from kvcache.backends.base import NativeAttendOf, StepKernel, WriteAttend
from kvcache.errors import InvalidRequest
from kvcache.metadata import AttentionMetadata, kv_rows, write_kv_rows
from kvcache.pool import PagePool


class StepAttention:
    """Implements :class:`~kvcache.attention.AttentionFn` for one step.

    Built only by ``KVCacheManager.begin_step`` after the fence has passed; every slot in
    ``metadata`` belongs to the sequence whose token it holds.
    """

    def __init__(self, metadata: AttentionMetadata, pool: PagePool, kernel: StepKernel) -> None:
        self.metadata = metadata
        self._pool = pool
        self._kernel = kernel
        self._rows = kv_rows(metadata.slot_mapping, pool.page_size)  # shared by all layers
        self._num_tokens = metadata.num_tokens
        self._kv_shape = (pool.num_kv_heads, pool.head_dim)
        # A kernel that can write the step's K/V rows and attend in one call (the torch
        # backend's, for an all-decode step on the CPU kernel) answers None when it cannot.
        self._write_attend: WriteAttend | None = getattr(kernel, "write_attend", None)
        self._native: NativeAttendOf | None = getattr(kernel, "native_attend", None)
        self._windows = metadata.windows or (0,) * pool.num_layers
        self._softcaps = metadata.softcaps or (0.0,) * pool.num_layers

    def native_attend(self, q_heads: int, every_chunk: bool = False) -> NativeAttend | None:
        """This step's attention for native model code (:class:`NativeAttend`), where the
        kernel offers it (the torch backend's, for an all-decode float32 step on the CPU
        kernel); else None, and the model calls this object per layer. ``every_chunk``
        asks for it whatever the step's prefill chunks (each token one kernel row, whose
        arithmetic is then the same in any batch: batch-invariant attention)."""
        if self._native is None:
            return None
        pool = self._pool
        if q_heads <= 0 or q_heads % pool.num_kv_heads != 0:
            raise InvalidRequest(f"{q_heads} query heads do not match the page pool")
        return self._native(q_heads, pool.kv, self._rows, every_chunk)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        t = self._num_tokens
        if q.shape[0] != t or k.shape[0] != t or v.shape[0] != t:
            raise InvalidRequest(
                f"step has {t} tokens but got q/k/v with {q.shape[0]}/{k.shape[0]}/{v.shape[0]}"
            )
        pool = self._pool
        if k.shape[1:] != self._kv_shape or q.shape[2] != pool.head_dim:
            raise InvalidRequest(f"k shape {tuple(k.shape)} does not match the page pool")
        if not 0 <= layer < pool.num_layers:
            raise InvalidRequest(f"layer {layer} out of range")
        kv_layer = pool.layer(layer)
        window, softcap = self._windows[layer], self._softcaps[layer]
        if self._write_attend is not None:
            out = self._write_attend(q, k, v, kv_layer, self._rows, window, softcap)
            if out is not None:
                return out
        write_kv_rows(kv_layer, k, v, self._rows)
        return self._kernel(q, kv_layer, window, softcap)
