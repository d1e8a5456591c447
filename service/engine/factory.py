"""Build an Engine with its page pool and KV cache manager from a loaded model.

This is the one place the service (and tests, benchmarks) wires model, kvcache and engine:

    engine = build_engine(loaded, EngineConfig(), CacheConfig(), kv_bytes=2 << 30)
    engine.start()

Exactly one of ``kv_pages`` / ``kv_bytes`` / ``kv_fraction`` sizes the pool
(``kvcache.size_pool``). The pool takes the model's
dtype and device; its geometry (layers, KV heads, head dim) comes from the model config.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvcache import CacheConfig, KVCacheManager, KVTier, LayerAttention, PagePool, size_pool
from kvcache.backends import AttentionBackend
from service.engine.core import EngineCore
from service.engine.engine import Engine
from service.engine.hooks import CoreHooks, EngineHooks
from service.engine.types import EngineConfig
from service.model.decoder import DecoderModel
from service.model.loader import LoadedModel
from service.model.threads import on_fresh_thread


def build_cache(
    model: DecoderModel,
    cache_config: CacheConfig,
    *,
    kv_pages: int | None = None,
    kv_bytes: int | None = None,
    kv_fraction: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    backend: AttentionBackend | None = None,
    tier: KVTier | None = None,
) -> KVCacheManager:
    """A KVCacheManager over a fresh PagePool shaped for ``model``, with ``tier`` below it
    (None: evicted pages are dropped). The pool is allocated (and zeroed) on a fresh thread
    (see :mod:`service.model.threads`)."""
    cfg = model.config
    kv_pages = size_pool(
        kv_pages=kv_pages,
        kv_bytes=kv_bytes,
        kv_fraction=kv_fraction,
        num_layers=cfg.num_layers,
        page_size=cache_config.page_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=model.kv_dtype,
        device=model.device,
    )
    pool = on_fresh_thread(
        lambda: PagePool(
            cfg.num_layers,
            kv_pages,
            cache_config.page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            model.kv_dtype,
            model.device,
            tuple(
                LayerAttention(window=w, softcap=cfg.attn_softcap)
                for w in cfg.layer_windows or (0,) * cfg.num_layers
            ),
        )
    )
    return KVCacheManager(pool, cache_config, clock, backend, tier=tier)


def build_engine(
    loaded: LoadedModel,
    engine_config: EngineConfig,
    cache_config: CacheConfig,
    *,
    kv_pages: int | None = None,
    kv_bytes: int | None = None,
    kv_fraction: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    backend: AttentionBackend | None = None,
    sampler_seed: int | None = None,
    tier: KVTier | None = None,
) -> Engine:
    """An unstarted Engine over a new pool; call ``start()`` (warm-up) before ``submit``."""
    cache = build_cache(
        loaded.model,
        cache_config,
        kv_pages=kv_pages,
        kv_bytes=kv_bytes,
        kv_fraction=kv_fraction,
        clock=clock,
        backend=backend,
        tier=tier,
    )
    engine = Engine(
        loaded.model, loaded.tokenizer, cache, engine_config, clock, sampler_seed=sampler_seed
    )
    engine.hooks = EngineHooks(engine, cache)  # the hooks come from here, not through layers
    return engine


def build_core(
    loaded: LoadedModel,
    engine_config: EngineConfig,
    cache_config: CacheConfig,
    *,
    kv_pages: int | None = None,
    kv_bytes: int | None = None,
    kv_fraction: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    backend: AttentionBackend | None = None,
    sampler_seed: int | None = None,
) -> EngineCore:
    """A thread-free EngineCore over a new pool, driven by hand (tests, profile, tools):
    ``core.add(...)``, then ``core.step()`` until ``not core.has_work()``."""
    cache = build_cache(
        loaded.model,
        cache_config,
        kv_pages=kv_pages,
        kv_bytes=kv_bytes,
        kv_fraction=kv_fraction,
        clock=clock,
        backend=backend,
    )
    core = EngineCore.for_model(
        loaded.model, loaded.tokenizer, cache, engine_config, clock, sampler_seed
    )
    core.hooks = CoreHooks(core, cache)  # the hooks come from here, not through layers
    return core
