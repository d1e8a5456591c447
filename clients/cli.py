"""Client verbs of the `kvfence` command: generate, chat, tokenize, usage, purge.

service/cli.py builds the top-level parser and calls `register`; `python -m clients.cli`
runs the same verbs on their own.

Exit codes:
    0        success
    1        a local error (unreadable TLS file, bad option value, protocol violation)
    2        command-line usage error (argparse)
    10 + N   the server answered with gRPC status code N, for example
             13 INVALID_ARGUMENT (3), 14 DEADLINE_EXCEEDED (4), 15 NOT_FOUND (5),
             17 PERMISSION_DENIED (7), 18 RESOURCE_EXHAUSTED (8), 23 INTERNAL (13),
             24 UNAVAILABLE (14), 26 UNAUTHENTICATED (16)
    130      interrupted (Ctrl-C)
Errors print one line on stderr, `kvfence: error: CODE: message`, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import TextIO

import structlog

from clients.channel import API_KEY_ENV, DEFAULT_TARGET, TARGET_ENV, TlsConfig
from clients.client import Client
from clients.errors import ClientError, KvfenceError
from clients.requests import GenerateOptions
from clients.types import Chunk, Finished, GenerateEvent, ProtocolError, Started

EXIT_OK = 0
EXIT_LOCAL_ERROR = 1
EXIT_STATUS_BASE = 10
EXIT_INTERRUPTED = 130

Verb = Callable[[argparse.Namespace, Client], int]


def exit_code(error: Exception) -> int:
    if isinstance(error, KvfenceError):
        return EXIT_STATUS_BASE + int(error.code.value[0])
    return EXIT_LOCAL_ERROR


EXIT_CODES_HELP = (
    "exit codes: 0 ok, 1 local error, 2 usage error, 10+N the server's gRPC "
    "status N (e.g. 24 UNAVAILABLE, 26 UNAUTHENTICATED), 130 interrupted"
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client verbs to the `kvfence` parser; each sets `func(args) -> int`."""
    common = _common_parser()
    sampling = _sampling_parser()
    add_parser = subparsers.add_parser

    def add(
        name: str, parents: list[argparse.ArgumentParser], help: str
    ) -> argparse.ArgumentParser:
        return add_parser(
            name, parents=parents, help=help, description=help, epilog=EXIT_CODES_HELP
        )

    p = add("generate", [common, sampling], "stream a completion of PROMPT to stdout")
    p.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--json", action="store_true", help="print one JSON object per event")
    p.set_defaults(func=_runner(_generate))

    p = add(
        "chat",
        [common, sampling],
        "interactive chat (server-side chat template); /exit or EOF ends it",
    )
    p.add_argument("--system", help="a system message that starts the conversation")
    p.set_defaults(func=_runner(_chat))

    p = add("tokenize", [common], "show the token ids of TEXT")
    p.add_argument("text")
    p.add_argument("--add-special-tokens", action="store_true")
    p.add_argument("--json", action="store_true", help="print ids and tokens as JSON")
    p.set_defaults(func=_runner(_tokenize))

    p = add("usage", [common], "your KV pages, cached prefixes and quotas")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_runner(_usage))

    p = add("purge", [common], "drop your cached prefixes")
    p.set_defaults(func=_runner(_purge))


def _common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument(
        "--target",
        default=os.environ.get(TARGET_ENV, DEFAULT_TARGET),
        help=f"server host:port (env {TARGET_ENV}; default {DEFAULT_TARGET})",
    )
    g.add_argument("--api-key", default=None, help=f"API key (env {API_KEY_ENV})")
    g.add_argument("--tls-ca", default=None, help="CA certificate (PEM); enables TLS")
    g.add_argument("--tls-cert", default=None, help="client certificate (PEM) for mTLS")
    g.add_argument("--tls-key", default=None, help="client key (PEM) for mTLS")
    g.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds")
    return p


def _sampling_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return p


def _options(args: argparse.Namespace) -> GenerateOptions:
    options = GenerateOptions(stop=list(args.stop))
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        options["temperature"] = args.temperature
    if args.top_p is not None:
        options["top_p"] = args.top_p
    if args.top_k is not None:
        options["top_k"] = args.top_k
    if args.seed is not None:
        options["seed"] = args.seed
    return options


def _client(args: argparse.Namespace) -> Client:
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        tls = TlsConfig(args.tls_ca, args.tls_cert, args.tls_key)
    return Client(args.target, api_key=args.api_key, tls=tls, timeout=args.timeout)


def _runner(verb: Verb) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if not structlog.is_configured():
            # structlog's default prints to stdout, which carries the command's output. Route
            # logs through stdlib logging instead: stderr, warnings and up, so the info-level
            # retry notices stay quiet and an error is the single line printed below.
            structlog.configure(
                processors=[
                    structlog.processors.add_log_level,
                    structlog.dev.ConsoleRenderer(colors=False),
                ],
                logger_factory=structlog.stdlib.LoggerFactory(),
            )
        try:
            with _client(args) as client:
                return verb(args, client)
        except (KvfenceError, ClientError, ProtocolError) as e:
            sys.stdout.flush()
            print(f"kvfence: error: {e}", file=sys.stderr)
            return exit_code(e)
        except KeyboardInterrupt:
            print("kvfence: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    return run


def _generate(args: argparse.Namespace, client: Client) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    events = client.generate(prompt, **_options(args))
    if args.json:
        for event in events:
            print(json.dumps(event_json(event)), flush=True)
    else:
        _stream_text(events, sys.stdout)
    return EXIT_OK


def event_json(event: GenerateEvent) -> dict[str, object]:
    kind = {Started: "started", Chunk: "chunk", Finished: "finished"}[type(event)]
    return {"event": kind, **asdict(event)}


def _stream_text(events: Iterable[GenerateEvent], out: TextIO) -> str:
    """Write chunk text as it arrives; returns the whole text."""
    parts: list[str] = []
    for event in events:
        if isinstance(event, Chunk):
            parts.append(event.text)
            out.write(event.text)
            out.flush()
    out.write("\n")
    out.flush()
    return "".join(parts)


def _chat(args: argparse.Namespace, client: Client) -> int:
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return EXIT_OK
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply = _stream_text(client.generate(messages=history, **_options(args)), sys.stdout)
        history.append({"role": "assistant", "content": reply})


def _tokenize(args: argparse.Namespace, client: Client) -> int:
    result = client.tokenize(args.text, add_special_tokens=args.add_special_tokens)
    if args.json:
        print(json.dumps({"token_ids": list(result.token_ids), "tokens": list(result.tokens)}))
    else:
        print(" ".join(str(t) for t in result.token_ids))
    return EXIT_OK


def _usage(args: argparse.Namespace, client: Client) -> int:
    usage = asdict(client.usage())
    if args.json:
        print(json.dumps(usage))
        return EXIT_OK
    quotas = usage.pop("quotas")
    for key, value in {**usage, **{f"quota.{k}": v for k, v in quotas.items()}}.items():
        print(f"{key}: {value}")
    return EXIT_OK


def _purge(args: argparse.Namespace, client: Client) -> int:
    print(f"purged {client.purge()} pages")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfence", description="kvfence client")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
