"""Build and run the whole server: model -> KV pool -> engine -> gRPC server.

``build_server`` wires a loaded model into a started engine and an (unstarted)
``KVFenceServer``; the CLI and the tests both use it. ``serve`` is the ``kvfence serve``
process: it prints one line once it serves, reloads the tenants file on SIGHUP, and drains
on SIGTERM/SIGINT before exiting 0.

``pool_pages`` sizes the KV pool (through ``kvcache.size_pool``, the one rule) from the flags
and the model's shape, which the model file's header gives before any weight is read: so
``serve`` refuses tenant KV quotas that cannot all be honoured (``check_shares_before_load``)
in about a second instead of after the load. For a byte ``--kv-memory`` that figure is the
pool's exact size. For a fraction of free memory it is only an upper bound (the weights take
their memory first): quotas over it are refused before the load, and the real pool is checked
when ``KVFenceServer`` is built (and on each SIGHUP reload), as before.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from structlog.typing import FilteringBoundLogger

from kvcache.pool import page_bytes
from service.admission.kv_shares import KVShareError, kv_shares
from service.admission.tenant_adapters import LoraSettings
from service.admission.tenants import Tenant, TenantRegistry, load_tenants
from service.model.lora import LoraError
from service.serve.kvfence_server import KVFenceServer, ServedModel
from service.serve.settings import (
    ConfigError,
    EngineSizing,
    ServeConfig,
    ServerOptions,
    cache_config,
    engine_config,
    kv_budget,
    kv_tier,
)
from service.serve.shared_prefixes import (
    SharedPrefixError,
    shared_page_budget,
    shared_prefix_ids,
)
from service.serve.startup import StartupInterrupted, until_stopped

if TYPE_CHECKING:
    import torch

    from service.engine.engine import Engine
    from service.model.loader import LoadedModel
    from service.model.model_config import ModelConfig
    from service.structured.grammar import GrammarCompiler

__all__ = [
    "ConfigError",
    "EngineSizing",
    "ServeConfig",
    "Stack",
    "build_server",
    "check_shares_before_load",
    "load_for_serving",
    "pool_pages",
    "serve",
]


def pool_pages(
    sizing: EngineSizing, model: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> int:
    """Pages in the KV pool for these flags and this model's shape. A fraction of free memory
    is taken of the memory free now. Raises ``ConfigError`` when the budget holds no page."""
    from kvcache import size_pool

    budget = kv_budget(sizing)
    try:
        return size_pool(
            kv_bytes=budget.kv_bytes,
            kv_fraction=budget.kv_fraction,
            num_layers=model.num_layers,
            page_size=sizing.page_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=dtype,
            device=device,
        )
    except ValueError as err:
        raise ConfigError(f"--kv-memory: {err}") from None


def check_shares_before_load(
    config: ServeConfig, tenants: Mapping[str, Tenant], model: ModelConfig
) -> int:
    """Refuse (``ConfigError``, one line) KV quotas that the pool cannot hold, unless
    ``--kv-overcommit``; needs only the model's header. Returns the pool's pages as known
    before the load (exact for a byte budget, an upper bound for a fraction)."""
    from service.model.loader import resolve_kv_dtype

    sizing = config.sizing
    pages = pool_pages(
        sizing, model, resolve_kv_dtype(sizing.dtype, sizing.device, sizing.weights), sizing.device
    )
    try:
        kv_shares(tenants, pages, config.options.kv_overcommit)
    except KVShareError as err:
        if kv_budget(sizing).kv_fraction is None:
            raise ConfigError(str(err)) from None
        raise ConfigError(
            f"{err} ({pages} pages is the most --kv-memory {sizing.kv_memory} can hold: that "
            "fraction of the memory free before the model loads)"
        ) from None
    return pages


@dataclass(slots=True)
class Stack:
    """A started engine and the server in front of it."""

    engine: Engine
    server: KVFenceServer
    model: LoadedModel
    grammars: GrammarCompiler | None = None


def build_server(
    loaded: LoadedModel,
    sizing: EngineSizing,
    registry: TenantRegistry,
    options: ServerOptions,
    log: FilteringBoundLogger,
    *,
    tenants_path: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Stack:
    """Size the KV pool, start (warm up) the engine and build the server around it."""
    from service.engine.factory import build_engine
    from service.structured.compile_executor import CompileExecutor
    from service.structured.compiler import build_grammar_compiler

    cfg = loaded.model.config
    try:
        shared_ids = shared_prefix_ids(
            registry.shared_prefixes, loaded.tokenizer, loaded.chat_template
        )
    except SharedPrefixError as err:
        raise ConfigError(str(err)) from None
    shared_pages = shared_page_budget(shared_ids, sizing.page_size)
    try:
        cache = cache_config(sizing, shared_pages)
        engine_cfg = engine_config(sizing, cfg.max_position_embeddings)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    pages = pool_pages(sizing, cfg, loaded.model.kv_dtype, loaded.model.device)
    if shared_pages >= pages:
        raise ConfigError(
            f"the tenants file's shared prefixes keep {shared_pages} KV pages (twice what "
            f"they take) and the pool has {pages}; shorten them or enlarge --kv-memory"
        )
    try:  # before the warm-up; KVFenceServer applies the shares (and again on each reload)
        kv_shares(registry.tenants, pages - shared_pages, options.kv_overcommit)
    except KVShareError as err:
        raise ConfigError(str(err)) from None
    try:
        engine = build_engine(
            loaded,
            engine_cfg,
            cache,
            kv_pages=pages,
            clock=clock,
            sampler_seed=sizing.sampler_seed,
            tier=kv_tier(sizing),
        )
    except ValueError as err:
        raise ConfigError(f"--kv-memory: {err}") from None
    engine.start(progress=lambda done, total: log.info("engine.warmup", done=done, total=total))
    # One compile thread: a compile takes a whole core, and the engine's steps need the rest.
    compiles = CompileExecutor(workers=1, on_cost=engine.charge_cpu)
    grammars = build_grammar_compiler(
        loaded.tokenizer, cfg.vocab_size, cfg.eos_token_ids, executor=compiles
    )
    served = ServedModel(
        name=loaded.name,
        architecture=cfg.arch,
        dtype=str(loaded.dtype).removeprefix("torch."),
        vocab_size=cfg.vocab_size,
        max_model_len=engine.config.max_model_len,
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        default_ttl_s=sizing.prefix_ttl_s,
        lora=LoraSettings(
            cfg,
            loaded.model.dtype,
            options.max_lora_rank,
            options.max_loras_per_tenant,
            page_bytes(
                cfg.num_layers, engine.page_size, cfg.num_kv_heads, cfg.head_dim,
                loaded.model.kv_dtype,
            ),
        ),
    )
    try:
        server = KVFenceServer(
            engine=engine,
            model=served,
            registry=registry,
            options=options,
            log=log,
            tenants_path=tenants_path,
            clock=clock,
            grammars=grammars,
        )
    except (KVShareError, LoraError) as err:
        engine.shutdown()
        raise ConfigError(str(err)) from None
    return Stack(engine=engine, server=server, model=loaded, grammars=grammars)


def load_for_serving(
    config: ServeConfig, log: FilteringBoundLogger
) -> tuple[LoadedModel, TenantRegistry]:
    """The tenants file and the model. The model's header is read first and the tenants' KV
    quotas checked against the pool it implies, so a bad configuration is refused before the
    weights load (``check_shares_before_load``)."""
    from service.model import load_model, open_model
    from service.model.catalog import CATALOG, ensure_model
    from service.model.default import ensure_default_model
    from service.model.hub import parse_hub_name, resolve_hub_model

    registry = load_tenants(config.tenants)
    named = config.model in CATALOG and not Path(str(config.model)).exists()
    path = Path(config.model) if config.model not in (None, "", "default") else None
    hub = None
    if path is not None and not named and not path.exists():
        hub = parse_hub_name(str(config.model))
        if hub is None:
            raise ConfigError(f"--model: {path} does not exist")
    template = None
    if named:
        model_path = ensure_model(str(config.model))
        template = CATALOG[str(config.model)].chat_template
    elif hub is not None:
        model_path = resolve_hub_model(hub, revision=config.revision, progress=sys.stderr.isatty())
    else:
        model_path = path if path is not None else ensure_default_model()
    log.info("model.loading", path=str(model_path))
    opened = open_model(model_path)
    check_shares_before_load(config, registry.tenants, opened.config)
    loaded = load_model(
        opened,
        dtype=config.sizing.dtype,
        device=config.sizing.device,
        weights=config.sizing.weights,
        batch_invariant=config.sizing.batch_invariant,
        progress=sys.stderr.isatty(),
        chat_template=template,
    )
    if hub is not None and model_path.is_dir():
        # A snapshot directory is named by its commit hash: the repository names the model.
        loaded = replace(loaded, name=hub.repo_id)
    return loaded, registry


async def serve(config: ServeConfig, log: FilteringBoundLogger) -> int:
    """Run until SIGTERM/SIGINT, then drain. Returns the exit status.

    Signal handlers go in first: a signal while the model loads or warms up raises
    ``StartupInterrupted`` at once (exit 0 for SIGTERM, 130 for SIGINT) without serving, and
    a SIGHUP before the server exists is ignored (the file is read at start anyway).
    """
    stop = asyncio.Event()
    signals: list[int] = []
    servers: list[KVFenceServer] = []
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        signals.append(signum)
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_signal, signal.SIGTERM)
    loop.add_signal_handler(signal.SIGINT, on_signal, signal.SIGINT)
    loop.add_signal_handler(signal.SIGHUP, lambda: [s.reload_tenants() for s in servers])

    def start() -> tuple[Stack, TenantRegistry]:
        loaded, registry = load_for_serving(config, log)
        log.info("engine.starting", warmup=config.sizing.warmup)
        stack = build_server(
            loaded, config.sizing, registry, config.options, log, tenants_path=config.tenants
        )
        return stack, registry

    started = await until_stopped(start, stop)
    if started is None:
        raise StartupInterrupted(130 if signals[0] == signal.SIGINT else 0)
    stack, registry = started
    loaded = stack.model
    server = stack.server
    servers.append(server)
    try:
        if stop.is_set():
            return 0
        if stack.grammars is not None:  # before serving: no tenant times this build
            await asyncio.to_thread(stack.grammars.warm)
        port = await server.start()
        # NOTE: what is alive now (the model, torch, grpc, the tenants) lives as long as the
        # server; freezing it keeps the cyclic GC from walking it. Measured on a 2-core EPYC:
        # a full collection over the ~215,000 startup objects took ~115 ms with the GIL held
        # (every stream's next token waits), 0 after the freeze.
        gc.freeze()
        opts = config.options
        tls = "mtls" if opts.tls and opts.tls.client_ca else "on" if opts.tls else "off"
        metrics = server.metrics_server.port if server.metrics_server is not None else "off"
        print(
            f"kvfence: serving {loaded.name} on {opts.host}:{port} "
            f"(tls={tls}, tenants={len(registry.tenants)}, metrics={metrics})",
            flush=True,
        )
        if server.http is not None:
            scheme = "https" if opts.tls else "http"
            print(
                f"kvfence: OpenAI-compatible HTTP on "
                f"{scheme}://{opts.http_host or opts.host}:{server.http.port}/v1",
                flush=True,
            )
        if opts.otlp_endpoint:
            print(f"kvfence: tracing: OTLP spans to {opts.otlp_endpoint}", flush=True)
        log.info("server.serving", model=loaded.name, host=opts.host, port=port, tls=tls)
        await stop.wait()
        await server.drain()
    finally:
        await server.close()
        if stack.grammars is not None:
            stack.grammars.shutdown()
        await asyncio.to_thread(stack.engine.shutdown)
    return 0
