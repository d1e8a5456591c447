"""``kvfence``: serve | tenants add | models pull, plus the client verbs from ``clients.cli``.

Every ``serve`` flag can also be set by an environment variable ``KVFENCE_<FLAG>`` (upper
case, dashes as underscores: ``--kv-memory`` -> ``KVFENCE_KV_MEMORY``); the flag wins.
torch, the model and the engine are imported only inside ``serve`` and ``models pull``,
so the client verbs run on the base install. Errors are one line on stderr and a non-zero
exit (2 for bad input), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from clients import cli as client_cli

ENV_PREFIX = "KVFENCE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _add(parser: argparse.ArgumentParser, flag: str, default: Any, help: str, **kw: Any) -> None:
    """A flag whose default comes from ``KVFENCE_<FLAG>`` when that is set."""
    env = os.environ.get(_env_name(flag))
    kind: Callable[[str], Any] | None = kw.get("type")
    if env is not None:
        try:
            default = kind(env) if kind is not None else env
        except ValueError:
            raise UsageError(f"{_env_name(flag)}={env!r}: not a valid value for {flag}") from None
    parser.add_argument(flag, default=default, help=f"{help} [env {_env_name(flag)}]", **kw)


def _add_switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    env = os.environ.get(_env_name(flag), "").strip().lower()
    if env not in _TRUE | _FALSE:
        raise UsageError(f"{_env_name(flag)}={env!r}: use 1/0, true/false, yes/no")
    parser.add_argument(
        flag, action="store_true", default=env in _TRUE, help=f"{help} [env {_env_name(flag)}]"
    )


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the gRPC inference server")
    _add(p, "--model", "default", "a .gguf file, an HF directory, or 'default'")
    _add(p, "--host", "127.0.0.1", "address to bind")
    _add(p, "--port", 50051, "port to bind (0 = any free port)", type=int)
    _add(p, "--tenants", "tenants.toml", "tenants file (TOML)")
    _add(p, "--tls-cert", None, "server certificate (PEM)")
    _add(p, "--tls-key", None, "server private key (PEM)")
    _add(p, "--tls-client-ca", None, "CA for client certificates: enables mTLS")
    _add(p, "--metrics-port", None, "serve Prometheus /metrics on this port", type=int)
    _add(p, "--metrics-host", "127.0.0.1", "address for /metrics")
    _add(p, "--grace-seconds", 10.0, "on SIGTERM, time in-flight streams get to finish", type=float)
    _add_switch(p, "--reflection", "enable gRPC server reflection (authenticated)")
    _add_switch(p, "--log-content", "DEBUG ONLY: log prompt and output text")
    _add(
        p,
        "--log-format",
        "auto",
        "json, console, or auto (console on a TTY)",
        choices=["json", "console", "auto"],
    )
    _add(p, "--kv-memory", "512MiB", "KV pool size: bytes (512MiB, 2GB) or a fraction (0.5)")
    _add(p, "--max-num-seqs", 64, "most sequences in one batch", type=int)
    _add(p, "--max-num-batched-tokens", 512, "token budget of one engine step", type=int)
    _add(p, "--max-model-len", 0, "context length (0 = the model's)", type=int)
    _add(p, "--page-size", 16, "tokens per KV page", type=int)
    _add(p, "--dtype", "auto", "auto, float32, bfloat16 or float16")
    _add(p, "--device", "cpu", "torch device (cpu, cuda, cuda:1)")
    _add(
        p,
        "--scrub-policy",
        "reassign",
        "when KV pages are zeroed",
        choices=["reassign", "always", "off"],
    )
    _add(p, "--prefix-ttl", 600.0, "default prefix-cache TTL in seconds", type=float)
    _add(p, "--alert-tenant-kv-pages", 0, "warn when a tenant holds more pages (0 = off)", type=int)
    _add(
        p,
        "--alert-request-kv-pages",
        0,
        "warn when one request holds more pages (0 = off)",
        type=int,
    )
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from service.logging import make_logger
    from service.serve import EngineSizing, ServeConfig, serve
    from service.server import ServerOptions, TlsFiles

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = None
    if args.tls_cert is not None:
        tls = TlsFiles(
            Path(args.tls_cert),
            Path(args.tls_key),
            Path(args.tls_client_ca) if args.tls_client_ca else None,
        )
        for f in (tls.cert, tls.key, tls.client_ca):
            if f is not None and not f.is_file():
                raise UsageError(f"{f}: TLS file not found")
    options = ServerOptions(
        host=args.host,
        port=args.port,
        tls=tls,
        grace_s=args.grace_seconds,
        reflection=args.reflection,
        log_content=args.log_content,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        alert_tenant_kv_pages=args.alert_tenant_kv_pages,
        alert_request_kv_pages=args.alert_request_kv_pages,
    )
    sizing = EngineSizing(
        kv_memory=args.kv_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        dtype=args.dtype,
        device=args.device,
        scrub_policy=args.scrub_policy,
        prefix_ttl_s=args.prefix_ttl,
    )
    config = ServeConfig(
        model=args.model,
        tenants=Path(args.tenants),
        options=options,
        sizing=sizing,
        log_format=args.log_format,
    )
    log = make_logger(args.log_format, module_loggers=True)
    if args.log_content:
        log.warning("log_content.enabled", note="prompt and output text will be logged")
    return asyncio.run(serve(config, log))


def _tenants_add(args: argparse.Namespace) -> int:
    from service.tenants import add_tenant

    key = add_tenant(args.file, args.name)
    print(f"added tenant {args.name!r} to {args.file}")
    print(f"api key (shown once, only its sha256 is stored): {key}")
    return 0


def _models_pull(args: argparse.Namespace) -> int:
    from service.model.default import pull_default_model

    print(pull_default_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfence", description="multi-tenant LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    tenants = sub.add_parser("tenants", help="manage the tenants file")
    tsub = tenants.add_subparsers(dest="tenants_command", required=True, metavar="ACTION")
    add = tsub.add_parser("add", help="add a tenant with a fresh API key")
    add.add_argument("name")
    add.add_argument("--file", default="tenants.toml", help="tenants file (created if absent)")
    add.set_defaults(func=_tenants_add)
    models = sub.add_parser("models", help="manage local models")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    msub.add_parser("pull", help="download and verify the default model").set_defaults(
        func=_models_pull
    )
    client_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        result: int = args.func(args)
        return result
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if _is_user_error(err):
            print(f"kvfence: error: {err}", file=sys.stderr)
            return 2
        print(f"kvfence: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


def _is_user_error(err: Exception) -> bool:
    from service.tenants import TenantsFileError

    if isinstance(err, UsageError | TenantsFileError | FileNotFoundError):
        return True
    names = {cls.__name__ for cls in type(err).__mro__}
    # ConfigError (service.serve) and ModelLoadError (service.model) without importing torch.
    return bool(names & {"ConfigError", "ModelLoadError"})


if __name__ == "__main__":
    sys.exit(main())
