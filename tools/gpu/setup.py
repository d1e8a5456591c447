"""Wiring for the checks: a cache with the chosen backend, and decode graphs over it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache import CacheConfig, KVCacheManager, PagePool
from kvcache.backends import AttentionBackend, TorchBackend
from kvcache.backends.flashinfer_backend import FlashInferBackend, HeadShape
from kvcache.graph_step import graph_kernels
from service.engine.cuda_graphs import DecodeGraphs, cuda_available, cuda_recorder, eager_recorder
from service.model.decoder import DecoderModel

SECRET = b"gpu-check-secret-0123456789abcdef"


def make_backend(
    name: str,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionBackend:
    if name == "torch":
        return TorchBackend()
    if name == "flashinfer":
        shape = HeadShape(num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
        return FlashInferBackend(shape, device)
    raise ValueError(f"unknown backend {name!r}")


def make_cache(
    model: DecoderModel, backend_name: str, page_size: int, num_pages: int
) -> tuple[KVCacheManager, AttentionBackend]:
    c = model.config
    backend = make_backend(
        backend_name, c.num_heads, c.num_kv_heads, c.head_dim, page_size, model.dtype, model.device
    )
    pool = PagePool(
        c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, model.dtype, model.device
    )
    cache = KVCacheManager(
        pool, CacheConfig(page_size=page_size, secret=SECRET), lambda: 0.0, backend
    )
    return cache, backend


def make_graphs(
    model: DecoderModel,
    cache: KVCacheManager,
    backend: AttentionBackend,
    buckets: Sequence[int],
    max_kv_len: int,
) -> DecodeGraphs:
    """Real CUDA graphs on a GPU; elsewhere the same static-buffer path replayed eagerly."""
    device = model.device
    recorder = (
        cuda_recorder(torch.cuda.graph_pool_handle()) if cuda_available(device) else eager_recorder
    )
    kernels = graph_kernels(backend, cache.pool, max_kv_len)
    return DecodeGraphs(model, cache.pool, kernels, buckets, recorder)
