"""Build and run the whole server: model -> KV pool -> engine -> gRPC server.

``build_server`` wires a loaded model into a started engine and an (unstarted)
``KVFenceServer``; the CLI and the tests both use it. ``serve`` is the ``kvfence serve``
process: it prints one line once it serves, reloads the tenants file on SIGHUP, and drains
on SIGTERM/SIGINT before exiting 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from structlog.typing import FilteringBoundLogger

from service.grpc_server import KVFenceServer, ServedModel, ServerOptions
from service.kv_shares import KVShareError
from service.preflight import ConfigError, parse_kv_memory
from service.startup import StartupInterrupted, until_stopped
from service.tenants import TenantRegistry, load_tenants

if TYPE_CHECKING:
    from kvcache import CacheConfig
    from service.engine.engine import Engine
    from service.engine.grammar import GrammarCompiler
    from service.engine.types import EngineConfig
    from service.model.loader import LoadedModel

@dataclass(frozen=True, slots=True)
class EngineSizing:
    """Engine and KV-pool settings (the engine-sizing flags of ``kvfence serve``)."""

    kv_memory: str = "512MiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 0  # 0 = the model's own context length
    page_size: int = 16
    dtype: str = "auto"
    device: str = "cpu"
    weights: str = "auto"  # --weights: auto | bf16 | int4 | int8 (service/model/packed.py)
    scrub_policy: Literal["reassign", "always", "off"] = "reassign"
    prefix_ttl_s: float = 600.0
    warmup: bool = True
    sampler_seed: int | None = None
    # Fair compute (issue 12): steps sized to last about max_step_ms (0 = the whole
    # max_num_batched_tokens every step); prefill_chunk caps one request's chunk while others
    # have work (0 = half the step's budget).
    max_step_ms: float = 100.0
    prefill_chunk: int = 0


def cache_config(sizing: EngineSizing) -> CacheConfig:
    """The KV cache's config, derived from the serve flags (raises ValueError if bad)."""
    from kvcache import CacheConfig

    return CacheConfig(
        page_size=sizing.page_size,
        scrub_policy=sizing.scrub_policy,
        default_ttl_s=sizing.prefix_ttl_s,
    )


def engine_config(sizing: EngineSizing, model_len: int) -> EngineConfig:
    """The engine's config, derived from the serve flags; ``max_model_len`` 0 means the
    model's own length (the engine caps larger values to it)."""
    from service.engine.types import EngineConfig

    return EngineConfig(
        max_num_seqs=sizing.max_num_seqs,
        max_num_batched_tokens=sizing.max_num_batched_tokens,
        max_model_len=sizing.max_model_len or model_len,
        warmup=sizing.warmup,
        max_step_ms=sizing.max_step_ms,
        long_prefill_threshold=sizing.prefill_chunk,
    )


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
    from service.structured import build_grammar_compiler

    cfg = loaded.model.config
    try:
        cache = cache_config(sizing)
        engine_cfg = engine_config(sizing, cfg.max_position_embeddings)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    kind, amount = parse_kv_memory(sizing.kv_memory)
    try:
        engine = build_engine(
            loaded,
            engine_cfg,
            cache,
            kv_fraction=amount if kind == "fraction" else None,
            kv_bytes=int(amount) if kind == "bytes" else None,
            clock=clock,
            sampler_seed=sizing.sampler_seed,
        )
    except ValueError as err:
        raise ConfigError(f"--kv-memory: {err}") from None
    engine.start(progress=lambda done, total: log.info("engine.warmup", done=done, total=total))
    grammars = build_grammar_compiler(loaded.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    served = ServedModel(
        name=loaded.name,
        architecture=cfg.arch,
        dtype=str(loaded.dtype).removeprefix("torch."),
        vocab_size=cfg.vocab_size,
        max_model_len=engine.config.max_model_len,
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        default_ttl_s=sizing.prefix_ttl_s,
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
    except KVShareError as err:
        engine.shutdown()
        raise ConfigError(str(err)) from None
    return Stack(engine=engine, server=server, model=loaded, grammars=grammars)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str | None
    tenants: Path
    options: ServerOptions
    sizing: EngineSizing
    log_format: Literal["json", "console", "auto"] = "auto"


def load_for_serving(
    config: ServeConfig, log: FilteringBoundLogger
) -> tuple[LoadedModel, TenantRegistry]:
    from service.model import load_model
    from service.model.default import ensure_default_model

    registry = load_tenants(config.tenants)
    path = Path(config.model) if config.model not in (None, "", "default") else None
    if path is not None and not path.exists():
        raise ConfigError(f"--model: {path} does not exist")
    model_path = path if path is not None else ensure_default_model()
    log.info("model.loading", path=str(model_path))
    loaded = load_model(
        model_path,
        dtype=config.sizing.dtype,
        device=config.sizing.device,
        weights=config.sizing.weights,
        progress=sys.stderr.isatty(),
    )
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
        log.info("server.serving", model=loaded.name, host=opts.host, port=port, tls=tls)
        await stop.wait()
        await server.drain()
    finally:
        await server.close()
        await asyncio.to_thread(stack.engine.shutdown)
    return 0
