"""What ``kvfence serve`` checks before it loads anything, so a bad start fails in a second.

Each check raises ``ConfigError`` with one line that names the flag and the fix. The port is
checked by binding it (and letting go): a second server on a used port fails here in well
under a second, instead of after the model load and warm-up. This module imports
neither torch nor the engine; only the ``--device cuda`` check does.
"""

from __future__ import annotations

import errno
import socket
import ssl
from pathlib import Path

from service.admission.tenants import TenantsFileError, load_tenants
from service.serve.settings import (
    ConfigError,
    ServeConfig,
    kv_tier_bytes,
    kv_tier_secret,
    parse_kv_memory,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_port(host: str, port: int, flag: str = "--port") -> None:
    if port == 0:
        return
    if not 0 < port < 65536:
        raise ConfigError(f"{flag} {port}: use 1-65535, or 0 for any free port")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ConfigError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        # SO_REUSEADDR: a port left in TIME_WAIT by a previous run is free; a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            raise ConfigError(_bind_error(host, port, flag, err)) from None


def _bind_error(host: str, port: int, flag: str, err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return (f"{flag} {port}: {host}:{port} is already in use (another kvfence serve?); "
                f"stop that process or pick another port ({flag} 0 picks a free one)")
    if err.errno == errno.EACCES:
        return f"{flag} {port}: permission denied (ports below 1024 need root); use a higher one"
    if err.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine; use 127.0.0.1 or 0.0.0.0"
    return f"--host {host} {flag} {port}: cannot bind ({err.strerror})"


def check_numbers(config: ServeConfig) -> None:
    sizing = config.sizing
    for flag, value, least in (("--max-num-seqs", sizing.max_num_seqs, 1),
                               ("--max-num-batched-tokens", sizing.max_num_batched_tokens, 1),
                               ("--max-model-len", sizing.max_model_len, 0),
                               ("--page-size", sizing.page_size, 1),
                               ("--prefix-ttl", sizing.prefix_ttl_s, 0),
                               ("--grace-seconds", config.options.grace_s, 0)):
        if value < least:
            raise ConfigError(f"{flag} {value}: must be at least {least}")
    if sizing.dtype not in DTYPES:
        raise ConfigError(f"--dtype {sizing.dtype}: use one of {', '.join(DTYPES)}")


def check_fair_compute(config: ServeConfig) -> None:
    if not 0 <= config.sizing.max_step_ms < float("inf"):  # NaN fails too
        raise ConfigError("--max-step-ms must be a number >= 0")
    if config.sizing.prefill_chunk < 0:
        raise ConfigError("--prefill-chunk must be >= 0")
    if not config.sizing.decode_stretch >= 0 or config.sizing.decode_stretch == float("inf"):
        raise ConfigError("--decode-stretch must be a number >= 0")


def check_redis_url(config: ServeConfig) -> None:
    cluster = config.options.cluster_limits
    if cluster is not None and not cluster.redis_url.startswith(
        ("redis://", "rediss://", "unix://")
    ):
        raise ConfigError(f"--redis-url {cluster.redis_url!r}: use redis://HOST:PORT/DB")


def check_cuda(device: str) -> None:
    """A CUDA device that this torch build and this machine can actually use."""
    if not device.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise ConfigError(f"--device {device}: this torch ({torch.__version__}) is built without "
                          "CUDA; use --device cpu, or install a CUDA build of torch")
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        seen = "no CUDA GPU is visible" if count == 0 else f"only {count} CUDA device(s)"
        raise ConfigError(f"--device {device}: {seen}; use --device cpu"
                          + (f" or cuda:0..{count - 1}" if count else ""))


def check_tls_files(config: ServeConfig) -> None:
    tls = config.options.tls
    if tls is None:
        return
    for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key),
                       ("--tls-client-ca", tls.client_ca)):
        if path is not None and not path.is_file():
            raise ConfigError(f"{flag} {path}: file not found (`kvfence certs dev` makes a set)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as err:
        raise ConfigError(f"--tls-cert {tls.cert} --tls-key {tls.key}: not a PEM "
                           f"certificate and its key ({err.reason or 'no PEM data found'})") from None
    if tls.client_ca is not None:
        try:
            ssl.create_default_context(cafile=str(tls.client_ca))
        except ssl.SSLError as err:
            raise ConfigError(f"--tls-client-ca {tls.client_ca}: not a PEM certificate "
                               f"({err.reason})") from None


def check_tenants(path: Path) -> None:
    hint = f"`kvfence tenants add NAME --file {path}` creates a tenant and prints its key"
    if not path.exists():
        raise ConfigError(f"--tenants {path}: file not found; {hint}")
    try:
        registry = load_tenants(path)
    except TenantsFileError as err:
        raise ConfigError(f"--tenants: {err}") from None
    if not registry.tenants:
        raise ConfigError(f"--tenants {path}: no tenants in it, so every call would be refused; "
                          + hint)


def check_model(model: str | None, revision: str | None = None) -> None:
    """A path that exists, a catalog name, or a Hugging Face repository name; under
    ``HF_HUB_OFFLINE`` the repository is looked up in the cache now (no network, quick)."""
    if model in (None, "", "default") or Path(model).exists():
        return
    from service.model.catalog import CATALOG  # imports torch: only for a name given
    from service.model.hub import parse_hub_name, resolve_hub_model
    from service.model.load_error import ModelLoadError

    if model in CATALOG:
        return
    try:
        hub = parse_hub_name(model)
        if hub is not None and _hub_offline():
            resolve_hub_model(hub, revision=revision, progress=False)
    except ModelLoadError as err:
        raise ConfigError(str(err)) from None
    if hub is None:
        raise ConfigError(f"--model {model}: no such file or directory; give a .gguf file, a "
                          "Hugging Face directory or repository (ORG/NAME[:FILE]), 'default' "
                          "or a name `kvfence models list` shows")


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def check_kv_tier(config: ServeConfig) -> None:
    """The tier's size and secret file parse, and its directory's parent exists (the
    directory itself is checked, and emptied of tier files, when the tier is built)."""
    sizing = config.sizing
    if sizing.kv_tier_dir is None:
        return
    kv_tier_bytes(sizing)
    kv_tier_secret(sizing)
    parent = Path(sizing.kv_tier_dir).absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"--kv-tier-dir {sizing.kv_tier_dir}: {parent} is not a directory")


def check_all(config: ServeConfig) -> None:
    """Every start-up check, cheapest first; only ``--device cuda`` imports torch. (The TLS
    flag pairs were checked when ``serve_config`` built ``config``.)"""
    opts = config.options
    check_tenants(config.tenants)
    check_model(config.model, config.revision)
    check_tls_files(config)
    check_numbers(config)
    check_port(opts.host, opts.port)
    if opts.metrics_port is not None:
        check_port(opts.metrics_host, opts.metrics_port, "--metrics-port")
    if opts.http_port is not None:
        check_port(opts.host, opts.http_port, "--http-port")
    parse_kv_memory(config.sizing.kv_memory)
    check_kv_tier(config)
    check_cuda(config.sizing.device)
    check_redis_url(config)
    check_fair_compute(config)
