"""Client verbs of the `kvfence` command: generate, chat, tokenize, usage, purge.

service/serve/commands.py builds the top-level parser and calls `register`; `python -m clients.cli`
runs the same verbs on their own.

Exit codes:
    0        success (also when the reader of stdout goes away, as in `| head`)
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

import grpc
import structlog

from clients.channel import API_KEY_ENV, DEFAULT_TARGET, TARGET_ENV, TlsConfig, resolve_api_key
from clients.cli_parser import add_command, new_parser, parse, unescape
from clients.client import Client
from clients.errors import ClientError, KvfenceError
from clients.requests import GenerateOptions
from clients.tls_probe import explain_unavailable
from clients.types import Chunk, Finished, GenerateEvent, ProtocolError, Started

EXIT_OK = 0
EXIT_LOCAL_ERROR = 1
EXIT_STATUS_BASE = 10
EXIT_INTERRUPTED = 130
SERVER_MAX_TOKENS = 16  # StoppingParams.max_tokens when unset (inference.proto)
CHAT_MAX_TOKENS = 256  # a chat turn is a few sentences; 16 tokens would cut it mid-word

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

    def add(name: str, parents: list[argparse.ArgumentParser],
            help: str) -> argparse.ArgumentParser:
        return add_command(subparsers, name, help, parents=parents, epilog=EXIT_CODES_HELP)

    p = add("generate", [common, _sampling_parser(None)],
            "stream a completion of PROMPT to stdout")
    p.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as one user message through the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per event")
    p.set_defaults(func=_runner(_generate))

    p = add("chat", [common, _sampling_parser(CHAT_MAX_TOKENS)],
            "interactive chat (server-side chat template); /exit or EOF ends it")
    p.add_argument("--system", help="a system message that starts the conversation")
    p.set_defaults(func=_runner(_chat))

    p = add("tokenize", [common], "show the token ids of TEXT")
    p.add_argument("text")
    p.add_argument("--add-special-tokens", action="store_true")
    p.add_argument("--json", action="store_true", help="print ids and tokens as JSON")
    p.set_defaults(func=_runner(_tokenize))

    p = add("usage", [common], "your KV pages, cached prefixes and quotas")
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    p.set_defaults(func=_runner(_usage))

    p = add("purge", [common], "drop your cached prefixes")
    p.set_defaults(func=_runner(_purge))


def _common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("connection")
    g.add_argument("--target", default=os.environ.get(TARGET_ENV, DEFAULT_TARGET),
                   help=f"server host:port (env {TARGET_ENV})")
    g.add_argument("--api-key", default=None, help=f"API key (env {API_KEY_ENV})")
    g.add_argument("--tls-ca", default=None, help="CA certificate (PEM); enables TLS")
    g.add_argument("--tls-cert", default=None, help="client certificate (PEM) for mTLS")
    g.add_argument("--tls-key", default=None, help="client key (PEM) for mTLS")
    g.add_argument("--timeout", type=float, default=None,
                   help="deadline per call, seconds (unset: none)")
    return p


def _sampling_parser(max_tokens: int | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("sampling (unset: the server's default, shown in brackets)")
    g.add_argument("--model", default=None,
                   help="the served model or one of your LoRA adapters, by name [the base]")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"most tokens to generate [{SERVER_MAX_TOKENS}]")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy [1.0]")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass [1.0]")
    g.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest [0 = off]")
    g.add_argument("--seed", type=int, default=None, help="sampling seed [random]")
    g.add_argument("--stop", action="append", default=[], type=unescape,
                   help=r"stop string, repeatable; \n \t \r \\ are escapes (--stop '\n\n')")
    return p


def _options(args: argparse.Namespace) -> GenerateOptions:
    options = GenerateOptions(stop=list(args.stop))
    if args.model is not None:
        options["model"] = args.model
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


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    if args.tls_ca or args.tls_cert or args.tls_key:
        return TlsConfig(args.tls_ca, args.tls_cert, args.tls_key)
    return None


def _explain(error: KvfenceError, args: argparse.Namespace) -> str:
    """The error line, with a hint where the raw status alone does not say what to do."""
    line = str(error)
    if error.code == grpc.StatusCode.UNAUTHENTICATED:
        if resolve_api_key(args.api_key) is None:
            return f"{line} (no API key given: pass --api-key KEY or set {API_KEY_ENV})"
        source = "--api-key" if args.api_key is not None else API_KEY_ENV
        return f"{line} (the key came from {source})"
    if error.code == grpc.StatusCode.UNAVAILABLE:
        reason = explain_unavailable(args.target, _tls(args))
        if reason is not None:
            return f"UNAVAILABLE: {reason}"
    return line


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
            with Client(args.target, api_key=args.api_key, tls=_tls(args),
                        timeout=args.timeout) as client:
                return verb(args, client)
        except BrokenPipeError:
            return _reader_gone()
        except KvfenceError as e:
            _flush()
            print(f"kvfence: error: {_explain(e, args)}", file=sys.stderr)
            return exit_code(e)
        except (ClientError, ProtocolError) as e:
            _flush()
            print(f"kvfence: error: {e}", file=sys.stderr)
            return exit_code(e)
        except KeyboardInterrupt:
            print("kvfence: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    return run


def _flush() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_gone()


def _reader_gone() -> int:
    """stdout's reader left (`| head`): that is how pipelines end, not an error.

    NOTE: stdout is pointed at /dev/null so the interpreter's final flush cannot fail again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OK


def _generate(args: argparse.Namespace, client: Client) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        events = client.generate(messages=[{"role": "user", "content": prompt}], **_options(args))
    else:
        events = client.generate(prompt, **_options(args))
    if args.json:
        for event in events:
            print(json.dumps(event_json(event)), flush=True)
    else:
        _stream_text(events, sys.stdout, args)
    return EXIT_OK


def event_json(event: GenerateEvent) -> dict[str, object]:
    kind = {Started: "started", Chunk: "chunk", Finished: "finished"}[type(event)]
    return {"event": kind, **asdict(event)}


def _stream_text(events: Iterable[GenerateEvent], out: TextIO, args: argparse.Namespace) -> str:
    """Write chunk text as it arrives, then say on stderr why it ended if it was cut short;
    returns the whole text."""
    parts: list[str] = []
    finished: Finished | None = None
    for event in events:
        if isinstance(event, Chunk):
            parts.append(event.text)
            out.write(event.text)
            out.flush()
        elif isinstance(event, Finished):
            finished = event
    out.write("\n")
    out.flush()
    if finished is not None:
        note = finish_note(finished, args)
        if note:
            print(f"kvfence: {note}", file=sys.stderr, flush=True)
    return "".join(parts)


def finish_note(finished: Finished, args: argparse.Namespace) -> str | None:
    """Why the text ended, when it did not end by itself (None for end of text)."""
    if finished.reason == "length":
        limit = args.max_tokens if args.max_tokens is not None else SERVER_MAX_TOKENS
        return (f"[stopped: reached --max-tokens {limit} "
                f"({finished.usage.completion_tokens} tokens); raise it for more]")
    if finished.reason == "stop" and args.stop:
        return "[stopped: a --stop string or the end of the text]"
    if finished.reason in ("abort", "deadline", "error"):
        return f"[stopped: {finished.reason}]"
    return None


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
        reply = _stream_text(client.generate(messages=history, **_options(args)), sys.stdout,
                             args)
        history.append({"role": "assistant", "content": reply})


def _tokenize(args: argparse.Namespace, client: Client) -> int:
    result = client.tokenize(args.text, add_special_tokens=args.add_special_tokens)
    if args.json:
        print(json.dumps({"token_ids": list(result.token_ids), "tokens": list(result.tokens)}))
    else:
        print(" ".join(str(t) for t in result.token_ids))
    return EXIT_OK


def figure(value: object) -> str:
    """A figure for people: floats to 3 decimals without trailing zeros (0.604, 600)."""
    if isinstance(value, float):
        return f"{round(value, 3):g}"
    return str(value)


def _usage(args: argparse.Namespace, client: Client) -> int:
    usage = asdict(client.usage())
    if args.json:
        print(json.dumps(usage))
        return EXIT_OK
    quotas = usage.pop("quotas")
    adapters = usage.pop("adapters")
    for key, value in {**usage, **{f"quota.{k}": v for k, v in quotas.items()}}.items():
        print(f"{key}: {figure(value)}")
    for a in adapters:
        name = a.pop("name")
        print(f"adapter.{name}: " + ", ".join(f"{k} {figure(v)}" for k, v in a.items()))
    return EXIT_OK


def _purge(args: argparse.Namespace, client: Client) -> int:
    print(f"purged {client.purge()} pages")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(prog="kvfence", description="kvfence client")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parse(parser, argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
