"""The configuration of ``kvfence serve``: built once from the command line, frozen, read by all.

``serve_config(args)`` is the only place flags become configuration::

    argparse.Namespace --serve_config--> ServeConfig
        .model, .tenants, .log_format
        .options: ServerOptions   the gRPC/HTTP server (read by KVFenceServer as it is)
        .sizing:  EngineSizing    the engine and KV-pool flags

Everything else is derived from a ``ServeConfig`` by the pure functions below, never built
from another derived config: ``engine_config`` (the engine), ``cache_config`` (kvcache),
``kv_budget`` (what ``kvcache.size_pool`` is given) and ``kv_tier`` (the KV tier, or none). ``service.serve.preflight`` checks a
``ServeConfig`` before anything loads. This module imports neither torch nor the engine
(``service.engine.tuning`` is plain data).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from service.admission.cluster_limits import ClusterLimitsConfig
from service.engine.tuning import SchedulerTuning
from service.grpc.health_service import DEFAULT_MAX_WATCHES

if TYPE_CHECKING:
    from kvcache import CacheConfig, KVTier
    from service.engine.types import EngineConfig
    from service.http.guard import HttpGuard

MiB = 1024 * 1024
TUNING = SchedulerTuning()  # the scheduling defaults: flags, EngineSizing and EngineConfig share them


class ConfigError(ValueError):
    """A bad ``kvfence serve`` flag or start-up file; the message is one readable line."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None  # set = mTLS: client certificates are required


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """The server's flags (everything ``KVFenceServer`` reads)."""

    host: str = "127.0.0.1"
    port: int = 0
    tls: TlsFiles | None = None
    # NOTE: large enough that a prompt far over any context length (~700k token ids, or its
    # text) still arrives and gets INVALID_ARGUMENT from validation; bigger messages are
    # refused by gRPC with RESOURCE_EXHAUSTED before they are parsed.
    max_message_bytes: int = 8 * MiB
    grace_s: float = 10.0
    reflection: bool = False
    log_content: bool = False
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None = no metrics endpoint; 0 = any free port
    alert_tenant_kv_pages: int = 0  # 0 = off
    alert_request_kv_pages: int = 0
    stats_interval_s: float = 1.0
    max_health_watches: int = DEFAULT_MAX_WATCHES  # open unauthenticated health Watch streams
    tokenizer_threads: int = 1  # tokenizations running at once (one per tenant at most)
    kv_overcommit: bool = False  # allow KV shares that add up to more than the pool
    http_host: str | None = None  # None = ``host``
    http_port: int | None = None  # None = no OpenAI-compatible HTTP front; 0 = any free port
    metrics_on_http: bool = False  # --metrics-on-http: /metrics on the HTTP port too
    cluster_limits: ClusterLimitsConfig | None = None  # None = limits local to this process
    http_guard: HttpGuard | None = None  # None = HttpGuard(): the HTTP front's bounds
    otlp_endpoint: str | None = None  # None = no tracing (opentelemetry is not even imported)
    max_lora_rank: int = 64  # --max-lora-rank: adapters of a higher rank are refused
    max_loras_per_tenant: int = 4  # --max-loras-per-tenant: resident adapters per tenant
    # --served-model-name: the names clients use for the base model, the first one its name
    # (in answers, model lists and tenants' ``models``); () = the model file's name.
    served_model_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineSizing:
    """Engine and KV-pool settings (the engine-sizing flags of ``kvfence serve``)."""

    kv_memory: str = "512MiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = TUNING.max_num_batched_tokens
    max_model_len: int = 0  # 0 = the model's own context length
    page_size: int = 16
    dtype: str = "auto"
    device: str = "cpu"
    weights: str = "auto"  # --weights: auto | bf16 | int4 | int8 (service/model/packed.py)
    # --batch-invariant: auto | on | off (service/model/loader.py, docs/batch-invariance.md)
    batch_invariant: str = "auto"
    compile: str = "off"  # --compile: auto | on | off (service/engine/compiled.py)
    scrub_policy: Literal["reassign", "always", "off"] = "reassign"
    prefix_ttl_s: float = 600.0
    warmup: bool = True
    sampler_seed: int | None = None
    # Fair compute (service/engine/tuning.py, docs/scheduling.md): no other tenant's work
    # makes a tenant's inter-token gap longer than decode_stretch times what its own rows
    # cost plus max_step_ms; prefill_chunk caps one request's chunk while others have work.
    max_step_ms: float = TUNING.max_step_ms
    prefill_chunk: int = TUNING.prefill_chunk
    decode_stretch: float = TUNING.decode_stretch
    # The KV tier (kvcache/tier.py): evicted cached pages, sealed per tenant, in files under
    # kv_tier_dir (None: no tier), within kv_tier_bytes, under the key in kv_tier_secret_file
    # (None: a random key for this process; the tier starts empty either way).
    kv_tier_dir: str | None = None
    kv_tier_bytes: str = "1GiB"
    kv_tier_secret_file: str | None = None


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything ``kvfence serve`` was told: the one config object, built by ``serve_config``."""

    model: str | None  # a path, a catalog name, ORG/NAME[:FILE], or None / "" / "default"
    tenants: Path
    options: ServerOptions
    sizing: EngineSizing
    log_format: Literal["json", "console", "auto"] = "auto"
    revision: str | None = None  # --revision: the Hugging Face revision of an ORG/NAME model


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


def _http_guard(args: argparse.Namespace) -> HttpGuard:
    if args.http_max_per_peer < 1:
        raise ConfigError("--http-max-per-peer must be at least 1")
    if not (0 < args.http_peer_rate < float("inf")):
        raise ConfigError("--http-peer-rate must be a number above 0")
    from service.http.guard import HttpGuard

    burst = max(1, round(2 * args.http_peer_rate))  # two seconds' worth, as by default
    return HttpGuard(
        max_per_peer=args.http_max_per_peer, paced_per_s=args.http_peer_rate, paced_burst=burst
    )


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ``kvfence serve`` flags as one frozen config. Raises ``ConfigError`` only for flag
    combinations it cannot represent; ``service.serve.preflight.check_all`` checks the rest."""
    cert, key, client_ca = _path(args.tls_cert), _path(args.tls_key), _path(args.tls_client_ca)
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if client_ca is not None and cert is None:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    cluster = None
    if args.redis_url:
        try:
            cluster = ClusterLimitsConfig(
                redis_url=args.redis_url,
                on_redis_failure=args.limits_on_redis_failure,
                lease_ttl_s=args.stream_lease_ttl,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
    options = ServerOptions(
        host=args.host,
        port=args.port,
        tls=TlsFiles(cert, key, client_ca) if cert is not None and key is not None else None,
        grace_s=args.grace_seconds,
        reflection=args.reflection,
        log_content=args.log_content,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        alert_tenant_kv_pages=args.alert_tenant_kv_pages,
        alert_request_kv_pages=args.alert_request_kv_pages,
        kv_overcommit=args.kv_overcommit,
        http_port=args.http_port,
        metrics_on_http=args.metrics_on_http,
        cluster_limits=cluster,
        otlp_endpoint=args.otlp_endpoint,
        max_lora_rank=args.max_lora_rank,
        max_loras_per_tenant=args.max_loras_per_tenant,
        served_model_names=tuple(args.served_model_name or ()),
        http_guard=_http_guard(args),
    )
    sizing = EngineSizing(
        kv_memory=args.kv_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        dtype=args.dtype,
        device=args.device,
        weights=args.weights,
        batch_invariant=args.batch_invariant,
        compile=args.compile,
        scrub_policy=args.scrub_policy,
        prefix_ttl_s=args.prefix_ttl,
        max_step_ms=args.max_step_ms,
        prefill_chunk=args.prefill_chunk,
        decode_stretch=args.decode_stretch,
        kv_tier_dir=args.kv_tier_dir,
        kv_tier_bytes=args.kv_tier_bytes,
        kv_tier_secret_file=args.kv_tier_secret_file,
    )
    return ServeConfig(
        model=args.model,
        tenants=Path(args.tenants),
        options=options,
        sizing=sizing,
        log_format=args.log_format,
        revision=args.revision,
    )


def cache_config(sizing: EngineSizing, shared_pages: int = 0) -> CacheConfig:
    """The KV cache's config, derived from the serve flags and the pages the tenants file's
    shared prefixes may hold (raises ValueError if bad)."""
    from kvcache import CacheConfig

    return CacheConfig(
        page_size=sizing.page_size,
        scrub_policy=sizing.scrub_policy,
        default_ttl_s=sizing.prefix_ttl_s,
        shared_pages=shared_pages,
    )


def kv_tier_bytes(sizing: EngineSizing) -> int:
    """``--kv-tier-bytes`` parsed (raises ``ConfigError``)."""
    size = _parse_size(sizing.kv_tier_bytes)
    if size is None or size < 1:
        raise ConfigError(
            f"--kv-tier-bytes: cannot parse {sizing.kv_tier_bytes!r} (use e.g. 512MiB or 4GB)"
        )
    return int(size)


def kv_tier_secret(sizing: EngineSizing) -> bytes:
    """The KV tier's key material: ``--kv-tier-secret-file``'s bytes (a regular file only
    this user can read, at least 16 bytes once trailing white space is cut), or 32 random
    bytes without one. Raises ``ConfigError``."""
    flag, name = "--kv-tier-secret-file", sizing.kv_tier_secret_file
    if name is None:
        return secrets.token_bytes(32)
    try:
        st = os.stat(name)
        data = Path(name).read_bytes().rstrip()
    except OSError as err:
        raise ConfigError(f"{flag} {name}: cannot read it ({err.strerror})") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(f"{flag} {name}: must be a file only its owner can read (chmod 600)")
    if len(data) < 16:
        raise ConfigError(f"{flag} {name}: holds {len(data)} bytes; use at least 16")
    return data


def kv_tier(sizing: EngineSizing) -> KVTier | None:
    """The KV tier the flags ask for, or None (``--kv-tier-dir`` unset). Creating it checks
    the directory and empties it of tier files. Raises ``ConfigError``."""
    if sizing.kv_tier_dir is None:
        return None
    from kvcache import KVTier

    budget, secret = kv_tier_bytes(sizing), kv_tier_secret(sizing)
    try:
        return KVTier(sizing.kv_tier_dir, budget, secret)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--kv-tier-dir {sizing.kv_tier_dir}: {err}") from None


def engine_config(sizing: EngineSizing, model_len: int) -> EngineConfig:
    """The engine's config, derived from the serve flags; ``max_model_len`` 0 means the
    model's own length (the engine caps larger values to it)."""
    from service.engine.types import EngineConfig

    return EngineConfig(
        max_num_seqs=sizing.max_num_seqs,
        max_model_len=sizing.max_model_len or model_len,
        tuning=scheduler_tuning(sizing),
        warmup=sizing.warmup,
        compile=sizing.compile,
    )


def scheduler_tuning(sizing: EngineSizing) -> SchedulerTuning:
    """The scheduling constants the serve flags set; the rest keep ``SchedulerTuning``'s."""
    return dataclasses.replace(
        TUNING,
        max_num_batched_tokens=sizing.max_num_batched_tokens,
        max_step_ms=sizing.max_step_ms,
        decode_stretch=sizing.decode_stretch,
        prefill_chunk=sizing.prefill_chunk,
    )


@dataclass(frozen=True, slots=True)
class KVBudget:
    """``--kv-memory`` parsed: exactly one of a byte budget or a fraction of free memory,
    as ``kvcache.size_pool`` takes them."""

    kv_bytes: int | None = None
    kv_fraction: float | None = None


def kv_budget(sizing: EngineSizing) -> KVBudget:
    """The KV pool's budget from ``--kv-memory`` (raises ``ConfigError`` if unparsable)."""
    kind, amount = parse_kv_memory(sizing.kv_memory)
    return KVBudget(kv_fraction=amount) if kind == "fraction" else KVBudget(kv_bytes=int(amount))


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


def parse_kv_memory(text: str) -> tuple[Literal["bytes", "fraction"], float]:
    """``512MiB``, ``2GB``, ``1073741824`` -> bytes; ``0.5`` (in (0, 1]) -> fraction of free
    device memory."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if 0.0 < value <= 1.0 and "." in text:
        return "fraction", value
    size = _parse_size(text)
    if size is None:
        raise ConfigError(f"--kv-memory: cannot parse {text!r} (use e.g. 512MiB, 2GB or 0.5)")
    if size < 1:
        raise ConfigError(f"--kv-memory: {text!r} is not a positive size")
    return "bytes", size


def _parse_size(text: str) -> float | None:
    """``512MiB``, ``2GB``, ``1073741824`` -> bytes; None if unparsable."""
    match = _SIZE_RE.match(text)
    if match is None:
        return None
    unit = (match.group(2) or "").upper().removesuffix("B")
    return float(match.group(1)) * _UNITS[unit]
