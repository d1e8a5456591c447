"""``kvfence``: serve | tenants add | models pull | certs dev, plus the client verbs.

Every ``serve`` flag can also be set by an environment variable ``KVFENCE_<FLAG>`` (upper
case, dashes as underscores: ``--kv-memory`` -> ``KVFENCE_KV_MEMORY``); the flag wins. The
variables are checked only when ``serve`` runs, so a bad ``KVFENCE_PORT`` cannot break
``kvfence usage``. torch, the model and the engine are imported only inside ``serve`` and
``models pull``, so the client verbs run on the base install. ``serve`` checks every flag,
the tenants file and the port before it loads the model. Errors are one line on stderr and
a non-zero exit (2 for bad input), never a traceback.
"""

from __future__ import annotations

import os

# NOTE: set before grpc is imported (clients.cli imports it): gRPC core otherwise prints its
# own log lines (`E1201 ... add_port.cc`, `Handshake failed`) next to our one-line errors.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import argparse
import asyncio
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from clients import cli as client_cli
from clients.cli_parser import add_command, new_parser, parse
from service.engine.tuning import SchedulerTuning
from service.serve.env_flags import UsageError, add_flag, add_repeated_flag, add_switch, resolve_env

# Short names for the flag table in _add_serve.
_add = add_flag
_add_switch = add_switch
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
# Top-level modules of the `server` extra: missing one means the client-only install.
SERVER_MODULES = {"torch", "gguf", "numpy", "tokenizers", "safetensors", "jinja2",
                  "prometheus_client", "grpc_health", "grpc_reflection", "cryptography",
                  "huggingface_hub"}


def check_device(text: str) -> str:
    """argparse type for ``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    if not _DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"use cpu, cuda or cuda:N (got {text!r})")
    return text


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from service.serve.preflight import DTYPES
    from service.serve.settings import EngineSizing

    tuning = SchedulerTuning()  # the one source of the scheduling flags' defaults
    p = add_command(sub, "serve", "run the gRPC inference server")
    _add(p, "--model", "default",
         "a .gguf file, an HF directory, 'default', a name from `kvfence models list`, or a "
         "Hugging Face repository ORG/NAME[:FILE.gguf] (fetched into the HF cache)")
    _add(p, "--revision", None, "the branch, tag or commit of an ORG/NAME --model (default main)")
    add_repeated_flag(p, "--served-model-name",
                      "a name clients use for the model, in `model` fields and model lists, "
                      "repeatable (the first is the name answers report; default: the model "
                      "file's name; in the environment, names separated by commas)", "NAME")
    _add(p, "--host", "127.0.0.1", "address to bind")
    _add(p, "--port", 50051, "port to bind (0 = any free port)", type=int)
    _add(p, "--tenants", "tenants.toml", "tenants file (TOML; `kvfence tenants add` writes it)")
    _add(p, "--tls-cert", None, "server certificate (PEM; `kvfence certs dev` makes one)")
    _add(p, "--tls-key", None, "server private key (PEM)")
    _add(p, "--tls-client-ca", None, "CA for client certificates: enables mTLS")
    _add(p, "--metrics-port", None, "serve Prometheus /metrics on this port", type=int)
    _add(p, "--metrics-host", "127.0.0.1", "address for /metrics")
    _add(p, "--http-port", None, "serve the OpenAI-compatible HTTP API on this port", type=int)
    _add_switch(p, "--metrics-on-http",
                "also serve Prometheus /metrics on the HTTP port (unauthenticated, paced per "
                "peer; it names every tenant: expose it to operators only, docs/openai.md)")
    _add(p, "--grace-seconds", 10.0, "on SIGTERM, time in-flight streams get to finish", type=float)
    _add_switch(p, "--reflection", "enable gRPC server reflection (authenticated)")
    _add_switch(p, "--log-content", "DEBUG ONLY: log prompt and output text")
    _add(p, "--log-format", "auto", "json, console, or auto (console on a TTY, else json)",
         choices=["json", "console", "auto"])
    _add(p, "--kv-memory", "512MiB", "KV pool size: bytes (512MiB, 2GB) or a fraction (0.5)")
    _add(p, "--max-num-seqs", 64, "most sequences in one batch", type=int)
    _add(p, "--max-num-batched-tokens", tuning.max_num_batched_tokens, "token budget of one engine step", type=int)
    _add(p, "--max-model-len", 0, "context length (0 = the model's)", type=int)
    _add(p, "--page-size", 16, "tokens per KV page", type=int)
    _add(p, "--dtype", "auto",
         "compute dtype. auto: bf16 on CUDA; on a CPU with bf16, float32 compute with bf16 "
         "dense weights and KV where kvfence's 4-bit GEMV serves decode, else bf16; "
         "float32 elsewhere", choices=list(DTYPES))
    _add(p, "--device", "cpu", "torch device: cpu, cuda or cuda:N", type=check_device,
         metavar="{cpu,cuda,cuda:N}")
    _add(p, "--weights", "auto",
         "decode weights: auto keeps the file's 4/8-bit blocks on CPU (bf16 via torch's "
         "int4 kernel, float32 via kvfence's GEMV); bf16 dense, int4, int8",
         choices=["auto", "bf16", "int4", "int8"])
    _add(p, "--batch-invariant", EngineSizing().batch_invariant,
         "a request's tokens never depend on what else is in the batch: on (refuse where it "
         "cannot), auto (on where kvfence's 4-bit GEMV serves the model on CPU), off (the "
         "batch-variant kernels, faster for long prefills: invariance costs 12-21 percent of "
         "offline throughput on CPU, docs/batch-invariance.md)",
         choices=["auto", "on", "off"])
    _add(p, "--compile", "off",
         "torch.compile small decode batches at start (CPU, bf16, a C++ compiler): "
         "auto where it can run, on (fail the start where it cannot), off",
         choices=["auto", "on", "off"])
    _add(p, "--scrub-policy", "reassign", "when KV pages are zeroed",
         choices=["reassign", "always", "off"])
    _add(p, "--prefix-ttl", 600.0, "default prefix-cache TTL in seconds", type=float)
    _add(p, "--alert-tenant-kv-pages", 0, "warn when a tenant holds more pages (0 = off)", type=int)
    _add(p, "--otlp-endpoint", None,
         "export OpenTelemetry request spans over OTLP/gRPC to this host:port (off when unset)")
    _add(
        p,
        "--alert-request-kv-pages",
        0,
        "warn when one request holds more pages (0 = off)",
        type=int,
    )
    # Tenant performance isolation (README "Isolation guarantees").
    _add(
        p,
        "--max-step-ms",
        tuning.max_step_ms,
        "while another tenant has work, the most time a tenant's prefill chunks may add to a "
        "step (0 = off; one tenant alone gets the whole token budget)",
        type=float,
    )
    _add(
        p,
        "--decode-stretch",
        tuning.decode_stretch,
        "a step the least-served decoding tenant's streams are in lasts at most this many "
        "times what their rows alone cost: others' decode rows and prefill chunks fit in "
        "that or wait a step (0 = off)",
        type=float,
    )
    _add(
        p,
        "--prefill-chunk",
        tuning.prefill_chunk,
        "one request's prefill tokens per step while others wait (0 = half the step's budget)",
        type=int,
    )
    _add_switch(p, "--kv-overcommit", "allow tenants' KV shares to add up to more than the pool")
    # The KV tier below the pool (kvcache/tier.py): off unless --kv-tier-dir is set.
    _add(p, "--kv-tier-dir", None,
         "keep evicted cached prefix pages in sealed per-tenant files in this directory "
         "(created 0700; must be yours and not group- or world-writable; emptied at start)")
    _add(p, "--kv-tier-bytes", EngineSizing().kv_tier_bytes,
         "the KV tier's size (512MiB, 4GB), shared among tenants by weight")
    _add(p, "--kv-tier-secret-file", None,
         "a file only you can read holding at least 16 bytes the tier's per-tenant keys are "
         "derived from (default: a random key for each process)")
    # Per-tenant LoRA adapters (docs/lora.md).
    _add(p, "--max-lora-rank", 64, "adapters of a higher rank are refused", type=int)
    _add(
        p,
        "--max-loras-per-tenant",
        4,
        "adapters of one tenant held in memory at once (idle ones are dropped, LRU)",
        type=int,
    )
    # Scale-out: cluster-wide tenant limits (see "Running more than one replica" in README).
    _add(p, "--redis-url", None, "keep tenant rate/stream limits in Redis, shared by replicas")
    _add(
        p,
        "--limits-on-redis-failure",
        "open",
        "Redis unreachable: open = this replica's own limits, closed = refuse (UNAVAILABLE)",
        choices=["open", "closed"],
    )
    _add(p, "--stream-lease-ttl", 10.0, "seconds a crashed replica's streams count", type=float)
    # The HTTP front's connection bounds (docs/hardening.md; behind a proxy every client
    # shares its address).
    _add(p, "--http-max-per-peer", 64,
         "HTTP connections one peer address may hold (behind a proxy: at least its pool)",
         type=int)
    _add(p, "--http-peer-rate", 50.0,
         "HTTP refusals and health checks one peer may get per second before they are held",
         type=float)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from service.serve.preflight import check_all
    from service.serve.settings import serve_config

    config = serve_config(args)  # the one config object; everything below reads it
    check_all(config)  # flags, files and ports, before anything loads

    from service.serve.app import serve
    from service.serve.startup import StartupInterrupted
    from service.telemetry.logs import make_logger

    log = make_logger(config.log_format, module_loggers=True)
    if config.options.log_content:
        log.warning("log_content.enabled", note="prompt and output text will be logged")
    try:
        return asyncio.run(serve(config, log))
    except StartupInterrupted as stopped:
        print("kvfence: stopped during start-up; nothing was served", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # NOTE: the abandoned loading thread may be inside torch; a normal interpreter exit
        # finalizes under it and can abort. Nothing is open that needs closing yet.
        os._exit(stopped.exit_code)


def _tenants_add(args: argparse.Namespace) -> int:
    from service.admission.tenants import add_tenant

    key = add_tenant(args.file, args.name)
    print(f"added tenant {args.name!r} to {args.file}")
    print(f"api key (shown once, only its sha256 is stored): {key}")
    return 0


def _models_pull(args: argparse.Namespace) -> int:
    from service.model.catalog import catalog_entry, pull_model

    print(pull_model(catalog_entry(args.name)))
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from service.model.catalog import CATALOG, model_path

    for model in CATALOG.values():
        state = "pulled" if model_path(model).exists() else "not pulled"
        print(f"{model.name:24} {model.about} ({model.file}, {state})")
    return 0


def _certs_dev(args: argparse.Namespace) -> int:
    from service.serve.devcerts import add_identity, write_dev_certs

    out = write_dev_certs(Path(args.dir), args.tenant, tuple(args.host), args.days)
    print(f"wrote {out.ca} (CA), {out.server_cert} + {out.server_key} (server), "
          f"{out.client_cert} + {out.client_key} (client of tenant {args.tenant!r})")
    if args.tenants is not None:
        add_identity(Path(args.tenants), args.tenant, f"uri:{out.identity}")
        print(f"mapped uri:{out.identity} to tenant {args.tenant!r} in {args.tenants}")
    else:
        print(f'add to [tenants.{args.tenant}] in your tenants file: '
              f'mtls_identities = ["uri:{out.identity}"]')
    print(f"serve:  kvfence serve --tls-cert {out.server_cert} --tls-key {out.server_key} "
          f"--tls-client-ca {out.ca} ...")
    print(f"call:   kvfence usage --tls-ca {out.ca} --tls-cert {out.client_cert} "
          f"--tls-key {out.client_key}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(prog="kvfence", description="multi-tenant LLM inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    tenants = add_command(sub, "tenants", "manage the tenants file")
    tsub = tenants.add_subparsers(dest="tenants_command", required=True, metavar="ACTION")
    add = add_command(tsub, "add", "add a tenant with a fresh API key")
    add.add_argument("name")
    add.add_argument("--file", default="tenants.toml", help="tenants file (created if absent)")
    add.set_defaults(func=_tenants_add)
    models = add_command(sub, "models", "manage local models")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    pull = add_command(msub, "pull", "download and verify a model (see `models list`)")
    pull.add_argument("name", nargs="?", default="default", help="model name (default: the default model)")
    pull.set_defaults(func=_models_pull)
    add_command(msub, "list", "the models `pull` and `serve --model NAME` know").set_defaults(
        func=_models_list
    )
    certs = add_command(sub, "certs", "make TLS certificates")
    csub = certs.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    dev = add_command(
        csub, "dev", "write a development CA, a server certificate and a tenant's client "
        "certificate (for trying TLS/mTLS locally; not for production)")
    dev.add_argument("--dir", default="certs", help="directory to write the PEM files to")
    dev.add_argument("--tenant", default="dev", help="tenant the client certificate is for")
    dev.add_argument("--tenants", default=None,
                     help="tenants file: map the client certificate to --tenant there")
    dev.add_argument("--host", action="append", default=[],
                     help="extra server name or IP (localhost, 127.0.0.1, ::1 always)")
    dev.add_argument("--days", type=int, default=30, help="validity in days")
    dev.set_defaults(func=_certs_dev)
    client_cli.register(sub)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; the chosen subcommand's ``KVFENCE_*`` defaults are converted here."""
    return resolve_env(parse(build_parser(), argv))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        result: int = args.func(args)
        return result
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as err:
        top = (err.name or "").partition(".")[0]
        if top not in SERVER_MODULES:
            raise
        print(f"kvfence: error: this command needs the server install (no module named {top!r}):"
              " pip install 'kvfence[server]'", file=sys.stderr)
        return 1
    except Exception as err:
        if _is_user_error(err):
            print(f"kvfence: error: {err}", file=sys.stderr)
            return 2
        print(f"kvfence: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


def _is_user_error(err: Exception) -> bool:
    from service.admission.tenants import TenantsFileError

    if isinstance(err, UsageError | TenantsFileError | FileNotFoundError):
        return True
    names = {cls.__name__ for cls in type(err).__mro__}
    # ConfigError (service.serve.settings), ModelLoadError (service.model) and CompileUnavailable
    # (service.engine.compiled) without importing torch.
    return bool(names & {"ConfigError", "ModelLoadError", "CompileUnavailable"})


if __name__ == "__main__":
    sys.exit(main())
