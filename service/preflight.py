"""What ``kvfence serve`` checks before it loads anything, so a bad start fails in a second.

Each check raises ``ConfigError`` with one line that names the flag and the fix. The port is
checked by binding it (and letting go): a second server on a used port fails here in well
under a second, instead of after the model load and warm-up. This module imports
neither torch nor the engine; only the ``--device cuda`` check does.
"""

from __future__ import annotations

import errno
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.tenants import TenantsFileError, load_tenants

DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    """A bad ``kvfence serve`` flag or start-up file; the message is one readable line."""


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
class StartupFlags:
    """The ``kvfence serve`` flags the checks read."""

    model: str | None
    tenants: Path
    host: str
    port: int
    metrics_host: str
    metrics_port: int | None
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    grace_s: float
    kv_memory: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    prefix_ttl_s: float
    dtype: str
    device: str
    http_port: int | None = None  # the OpenAI-compatible HTTP front, on ``host``


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


def check_numbers(flags: StartupFlags) -> None:
    for flag, value, least in (("--max-num-seqs", flags.max_num_seqs, 1),
                               ("--max-num-batched-tokens", flags.max_num_batched_tokens, 1),
                               ("--max-model-len", flags.max_model_len, 0),
                               ("--page-size", flags.page_size, 1),
                               ("--prefix-ttl", flags.prefix_ttl_s, 0),
                               ("--grace-seconds", flags.grace_s, 0)):
        if value < least:
            raise ConfigError(f"{flag} {value}: must be at least {least}")
    if flags.dtype not in DTYPES:
        raise ConfigError(f"--dtype {flags.dtype}: use one of {', '.join(DTYPES)}")


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


def check_tls_flags(flags: StartupFlags) -> None:
    if (flags.tls_cert is None) != (flags.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if flags.tls_client_ca is not None and flags.tls_cert is None:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")


def check_tls_files(flags: StartupFlags) -> None:
    if flags.tls_cert is None or flags.tls_key is None:
        return
    for flag, path in (("--tls-cert", flags.tls_cert), ("--tls-key", flags.tls_key),
                       ("--tls-client-ca", flags.tls_client_ca)):
        if path is not None and not path.is_file():
            raise ConfigError(f"{flag} {path}: file not found (`kvfence certs dev` makes a set)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(flags.tls_cert, flags.tls_key)
    except ssl.SSLError as err:
        raise ConfigError(f"--tls-cert {flags.tls_cert} --tls-key {flags.tls_key}: not a PEM "
                           f"certificate and its key ({err.reason or 'no PEM data found'})") from None
    if flags.tls_client_ca is not None:
        try:
            ssl.create_default_context(cafile=str(flags.tls_client_ca))
        except ssl.SSLError as err:
            raise ConfigError(f"--tls-client-ca {flags.tls_client_ca}: not a PEM certificate "
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


def check_model(model: str | None) -> None:
    if model in (None, "", "default"):
        return
    if not Path(model).exists():
        raise ConfigError(f"--model {model}: no such file or directory; give a .gguf file, a "
                          "Hugging Face directory, or 'default'")


def check_all(flags: StartupFlags) -> None:
    """Every start-up check, cheapest first; only ``--device cuda`` imports torch."""
    check_tls_flags(flags)
    check_tenants(flags.tenants)
    check_model(flags.model)
    check_tls_files(flags)
    check_numbers(flags)
    check_port(flags.host, flags.port)
    if flags.metrics_port is not None:
        check_port(flags.metrics_host, flags.metrics_port, "--metrics-port")
    if flags.http_port is not None:
        check_port(flags.host, flags.http_port, "--http-port")
    parse_kv_memory(flags.kv_memory)
    check_cuda(flags.device)
