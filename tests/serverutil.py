"""Real kvfence servers for tests: in-process (threaded or in your loop) and as a subprocess.

In-process, synchronous tests (the usual case)::

    from tests.serverutil import TenantSpec, running_server
    with running_server(model, {"acme": TenantSpec(), "globex": TenantSpec()}) as srv:
        stub = inference_pb2_grpc.InferenceStub(srv.channel())
        stream = stub.Generate(req, metadata=srv.auth("acme"))
        srv.usage("acme")    # TenantUsage, answered by the engine thread
        srv.stats()          # CacheStats, likewise

``model`` is a path (.gguf or HF dir) or an already loaded ``LoadedModel`` (share one per
session: loading is the slow part). The server binds 127.0.0.1:0 and runs its asyncio loop in
a background thread; ``srv.target`` is ``"127.0.0.1:PORT"``; ``srv.keys[tenant]`` is the
plaintext API key. Keyword overrides: ``sizing=EngineSizing(...)`` (engine/KV pool, warm-up
off by default), ``options=ServerOptions(...)`` (TLS, metrics_port=0, alerts...; host and
port are forced to 127.0.0.1:0), ``log_stream=io.StringIO()`` to capture the JSON log lines.

Inside an asyncio test, ``async with running_server_async(...)`` does the same in the
running loop (use ``grpc.aio`` channels then).

For signals (SIGTERM drain, SIGHUP reload) start a real process::

    proc = start_server_process(model_path, tenants_path, extra_args=["--grace-seconds", "5"])
    proc.target, proc.metrics_port; proc.popen.send_signal(signal.SIGTERM); proc.wait()

``srv.paused_engine()`` holds the engine thread at a step boundary (``Engine.paused``, a
documented test hook) so a stream provably stays open (see its doc).
``write_tenants_file(path, specs)`` writes a tenants file and returns the plaintext keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from kvcache.stats import CacheStats, TenantUsage
from service.admission.tenants import hash_key, load_tenants, new_api_key
from service.engine import Engine
from service.serve.app import EngineSizing, Stack, build_server
from service.serve.kvfence_server import KVFenceServer, ServerOptions
from service.telemetry.logs import make_logger

ROOT = Path(__file__).resolve().parents[1]
SERVING_RE = re.compile(r"^kvfence: serving (\S+) on ([\d.]+):(\d+) .*metrics=(\d+|off)\)")


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant of a test server; ``api_key`` None = a fresh random key."""

    weight: float = 1.0
    max_concurrent_streams: int = 16
    max_kv_pages: int = 0
    max_prompt_tokens: int = 0
    tokens_per_minute: int = 0
    prefix_cache_ttl_seconds: float | None = None
    mtls_identities: tuple[str, ...] = ()
    models: tuple[str, ...] | None = None
    allow_reflection: bool = False
    api_key: str | None = None
    with_key: bool = True  # False: mTLS identity only
    adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT LoRA directory)
    adapter_root: str | None = None  # run-time adapter loads (None: not allowed)


def write_tenants_file(path: Path, tenants: Mapping[str, TenantSpec]) -> dict[str, str]:
    """Write ``path`` and return {tenant: plaintext key} (tenants with a key only)."""
    keys: dict[str, str] = {}
    lines: list[str] = []
    for name, spec in tenants.items():
        lines.append(f'[tenants."{name}"]')
        if spec.with_key:
            keys[name] = spec.api_key or new_api_key()
            lines.append(f'api_key_sha256 = ["{hash_key(keys[name]).hex()}"]')
        if spec.mtls_identities:
            lines.append(f"mtls_identities = {_toml_list(spec.mtls_identities)}")
        lines.append(f"weight = {float(spec.weight)}")
        lines.append(f"max_concurrent_streams = {spec.max_concurrent_streams}")
        lines.append(f"max_kv_pages = {spec.max_kv_pages}")
        lines.append(f"max_prompt_tokens = {spec.max_prompt_tokens}")
        lines.append(f"tokens_per_minute = {spec.tokens_per_minute}")
        if spec.prefix_cache_ttl_seconds is not None:
            lines.append(f"prefix_cache_ttl_seconds = {float(spec.prefix_cache_ttl_seconds)}")
        if spec.models is not None:
            lines.append(f"models = {_toml_list(spec.models)}")
        lines.append(f"allow_reflection = {'true' if spec.allow_reflection else 'false'}")
        if spec.adapter_root is not None:
            lines.append(f"adapter_root = {json.dumps(spec.adapter_root)}")
        if spec.adapters:
            lines.append(f'[tenants."{name}".adapters]')
            lines.extend(f'"{a}" = "{path}"' for a, path in spec.adapters)
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return keys


def _toml_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


TEST_SIZING = EngineSizing(kv_memory="8MiB", max_model_len=512, warmup=False, dtype="float32")


@dataclass(slots=True)
class ServerHandle:
    target: str
    port: int
    keys: dict[str, str]
    stack: Stack
    tenants_path: Path
    log_stream: io.StringIO | None
    loop: asyncio.AbstractEventLoop
    metrics_port: int | None = None

    @property
    def server(self) -> KVFenceServer:
        return self.stack.server

    @property
    def engine(self) -> Engine:
        return self.stack.engine

    def auth(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.keys[tenant]}"),)

    def channel(self, **options: Any) -> grpc.Channel:
        return grpc.insecure_channel(self.target, options=list(options.items()))

    def usage(self, tenant: str) -> TenantUsage:
        """The tenant's usage, from the engine thread (call from a thread without a loop)."""
        return asyncio.run(self.engine.usage(tenant))

    def stats(self) -> CacheStats:
        return asyncio.run(self.engine.stats()).cache

    @contextlib.contextmanager
    def paused_engine(self) -> Iterator[None]:
        """Hold the engine thread at a step boundary: no step runs, so streams stay open.
        While paused, ``submit`` and queries wait (``abort`` does not), so only issue RPCs
        that refuse before reaching the engine (auth, validation, drain)."""
        with self.engine.paused():
            yield

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop (threaded servers) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def log_lines(self) -> list[str]:
        return [] if self.log_stream is None else self.log_stream.getvalue().splitlines()


def _load(model: Any, sizing: EngineSizing) -> Any:
    if isinstance(model, str | Path):
        from service.model import load_model

        return load_model(model, dtype=sizing.dtype, progress=False)
    return model


@contextlib.asynccontextmanager
async def running_server_async(
    model: Any,
    tenants: Mapping[str, TenantSpec] | Path,
    *,
    sizing: EngineSizing = TEST_SIZING,
    options: ServerOptions | None = None,
    log_stream: io.StringIO | None = None,
    tenants_dir: Path | None = None,
) -> AsyncIterator[ServerHandle]:
    """A started server in the running loop; closed (engine shut down) on exit."""
    loaded = await asyncio.to_thread(_load, model, sizing)
    with contextlib.ExitStack() as cleanup:
        if tenants_dir is None and not isinstance(tenants, Path):
            tenants_dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory()))
        tenants_path, keys = _tenants(tenants, tenants_dir)
        opts = replace(options or ServerOptions(), host="127.0.0.1", port=0)
        log = make_logger("json", log_stream if log_stream is not None else io.StringIO())
        stack = await asyncio.to_thread(
            build_server,
            loaded,
            sizing,
            load_tenants(tenants_path),
            opts,
            log,
            tenants_path=tenants_path,
        )
        try:
            port = await stack.server.start()
            metrics = stack.server.metrics_server
            yield ServerHandle(
                target=f"127.0.0.1:{port}",
                port=port,
                keys=keys,
                stack=stack,
                tenants_path=tenants_path,
                log_stream=log_stream,
                loop=asyncio.get_running_loop(),
                metrics_port=metrics.port if metrics is not None else None,
            )
        finally:
            await stack.server.close()
            if stack.grammars is not None:
                stack.grammars.shutdown()
            await asyncio.to_thread(stack.engine.shutdown)


def _tenants(
    tenants: Mapping[str, TenantSpec] | Path, tenants_dir: Path | None
) -> tuple[Path, dict[str, str]]:
    if isinstance(tenants, Path):
        return tenants, {}
    assert tenants_dir is not None
    path = tenants_dir / "tenants.toml"
    return path, write_tenants_file(path, tenants)


@contextlib.contextmanager
def running_server(
    model: Any,
    tenants: Mapping[str, TenantSpec] | Path,
    **kwargs: Any,
) -> Iterator[ServerHandle]:
    """``running_server_async`` on a background thread's loop, for synchronous tests."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kvfence-test-loop", daemon=True)
    thread.start()
    cm = running_server_async(model, tenants, **kwargs)
    try:
        handle = asyncio.run_coroutine_threadsafe(cm.__aenter__(), loop).result(120)
        try:
            yield handle
        finally:
            asyncio.run_coroutine_threadsafe(cm.__aexit__(None, None, None), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@dataclass(slots=True)
class ServerProcess:
    popen: subprocess.Popen[str]
    target: str
    port: int
    metrics_port: int | None
    output: list[str]

    def wait(self, timeout: float = 60.0) -> int:
        rc = self.popen.wait(timeout)
        return rc

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


def start_server_process(
    model_path: Path,
    tenants_path: Path,
    extra_args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> ServerProcess:
    """``python -m service.serve.commands serve`` on 127.0.0.1:0; returns once it prints its serving
    line. stdout is read on a thread into ``output``; logs (stderr) go to ``output`` too."""
    args = [
        sys.executable,
        "-m",
        "service.serve.commands",
        "serve",
        "--model",
        str(model_path),
        "--tenants",
        str(tenants_path),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-format",
        "json",
        "--kv-memory",
        "8MiB",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        *extra_args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    popen = subprocess.Popen(
        args,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    output: list[str] = []
    ready = threading.Event()
    found: list[re.Match[str]] = []

    def pump() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            output.append(line.rstrip("\n"))
            match = SERVING_RE.match(line)
            if match and not found:
                found.append(match)
                ready.set()
        ready.set()

    threading.Thread(target=pump, name="kvfence-proc-out", daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            popen.kill()
            raise TimeoutError("server did not print its serving line:\n" + "\n".join(output))
    if not found:
        popen.wait(10)
        raise RuntimeError(f"server exited ({popen.returncode}):\n" + "\n".join(output))
    m = found[0]
    metrics = None if m.group(4) == "off" else int(m.group(4))
    return ServerProcess(popen, f"127.0.0.1:{m.group(3)}", int(m.group(3)), metrics, output)
