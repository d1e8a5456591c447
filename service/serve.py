"""Build and run the whole server: model -> KV pool -> engine -> gRPC server.

``build_server`` wires a loaded model into a started engine and an (unstarted)
``KVFenceServer``; the CLI and the tests both use it. ``serve`` is the ``kvfence serve``
process: it prints one line once it serves, reloads the tenants file on SIGHUP, and drains
on SIGTERM/SIGINT before exiting 0.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from structlog.typing import FilteringBoundLogger

from service.server import KVFenceServer, ServedModel, ServerOptions
from service.tenants import TenantRegistry, load_tenants

if TYPE_CHECKING:
    from service.engine.engine import Engine
    from service.model.loader import LoadedModel

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KI": 2**10,
    "MI": 2**20,
    "GI": 2**30,
    "TI": 2**40,
}


class ConfigError(ValueError):
    """A bad flag value; the message is one readable line."""


def parse_kv_memory(text: str) -> tuple[Literal["bytes", "fraction"], float]:
    """``512MiB``, ``2GB``, ``1073741824`` -> bytes; ``0.5`` (in (0, 1]) -> fraction of free
    device memory."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if 0.0 < value <= 1.0 and "." in text:
        return "fraction", value
    match = _SIZE_RE.match(text)
    if match is None:
        raise ConfigError(f"--kv-memory: cannot parse {text!r} (use e.g. 512MiB, 2GB or 0.5)")
    unit = (match.group(2) or "").upper().removesuffix("B")
    size = float(match.group(1)) * _UNITS[unit]
    if size < 1:
        raise ConfigError(f"--kv-memory: {text!r} is not a positive size")
    return "bytes", size


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
    scrub_policy: Literal["reassign", "always", "off"] = "reassign"
    prefix_ttl_s: float = 600.0
    warmup: bool = True
    sampler_seed: int | None = None


@dataclass(slots=True)
class Stack:
    """A started engine and the server in front of it."""

    engine: Engine
    server: KVFenceServer
    model: LoadedModel


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
    from kvcache import CacheConfig
    from service.engine.factory import build_engine
    from service.engine.types import EngineConfig

    cfg = loaded.model.config
    try:
        cache_config = CacheConfig(
            page_size=sizing.page_size,
            scrub_policy=sizing.scrub_policy,
            default_ttl_s=sizing.prefix_ttl_s,
        )
        engine_config = EngineConfig(
            max_num_seqs=sizing.max_num_seqs,
            max_num_batched_tokens=sizing.max_num_batched_tokens,
            # 0 = the model's own length; the engine caps larger values to the model's.
            max_model_len=sizing.max_model_len or cfg.max_position_embeddings,
            warmup=sizing.warmup,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    kind, amount = parse_kv_memory(sizing.kv_memory)
    try:
        engine = build_engine(
            loaded,
            engine_config,
            cache_config,
            kv_fraction=amount if kind == "fraction" else None,
            kv_bytes=int(amount) if kind == "bytes" else None,
            clock=clock,
            sampler_seed=sizing.sampler_seed,
        )
    except ValueError as err:
        raise ConfigError(f"--kv-memory: {err}") from None
    engine.start()
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
    server = KVFenceServer(
        engine=engine,
        model=served,
        registry=registry,
        options=options,
        log=log,
        tenants_path=tenants_path,
        clock=clock,
    )
    return Stack(engine=engine, server=server, model=loaded)


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
        progress=sys.stderr.isatty(),
    )
    return loaded, registry


async def serve(config: ServeConfig, log: FilteringBoundLogger) -> int:
    """Run until SIGTERM/SIGINT, then drain. Returns the exit status.

    Signal handlers go in first: a SIGTERM while the model loads exits 0 without serving,
    and a SIGHUP before the server exists is ignored (the file is read at start anyway).
    """
    stop = asyncio.Event()
    servers: list[KVFenceServer] = []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: [s.reload_tenants() for s in servers])
    loaded, registry = await asyncio.to_thread(load_for_serving, config, log)
    stack = await asyncio.to_thread(
        build_server,
        loaded,
        config.sizing,
        registry,
        config.options,
        log,
        tenants_path=config.tenants,
    )
    server = stack.server
    servers.append(server)
    try:
        if stop.is_set():
            return 0
        port = await server.start()
        opts = config.options
        tls = "mtls" if opts.tls and opts.tls.client_ca else "on" if opts.tls else "off"
        metrics = server.metrics_server.port if server.metrics_server is not None else "off"
        print(
            f"kvfence: serving {loaded.name} on {opts.host}:{port} "
            f"(tls={tls}, tenants={len(registry.tenants)}, metrics={metrics})",
            flush=True,
        )
        log.info("server.serving", model=loaded.name, host=opts.host, port=port, tls=tls)
        await stop.wait()
        await server.drain()
    finally:
        await server.close()
        await asyncio.to_thread(stack.engine.shutdown)
    return 0
