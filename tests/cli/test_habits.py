"""CLI habits: escapes, pipes, exact flags, --version, usage, figures, hints, finish notes."""

from __future__ import annotations

import subprocess
import sys
import threading
from importlib import metadata

from protos.kvfence.v1 import inference_pb2
from tests.cli.conftest import ROOT, RealServer, clean_env, kvfence
from tests.clients.fakeserver import GOOD_KEY, FakeInference, serve


def _requests(fake: FakeInference) -> list[inference_pb2.GenerateRequest]:
    return [r for r in fake.seen.requests if isinstance(r, inference_pb2.GenerateRequest)]


def test_stop_escapes_reach_the_server_as_newlines(fake: FakeInference, fake_target: str) -> None:
    # What the README shows: --stop "\n\n" (the shell passes backslash-n literally).
    run = kvfence("generate", "hi", "--target", fake_target, "--api-key", GOOD_KEY,
                  "--stop", "\\n\\n", "--stop", "a\\tb", "--stop", "\\\\n")
    assert run.returncode == 0, run.stderr
    assert list(_requests(fake)[0].stopping.stop) == ["\n\n", "a\tb", "\\n"]


def test_closed_pipe_exits_0_without_a_word() -> None:
    """`kvfence generate ... --json | head -1`: the reader leaves while chunks still come."""
    gate = threading.Event()
    fake = FakeInference(gate=gate)
    with serve(fake) as target:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.serve.commands", "generate", "hi", "--json", "--target", target,
             "--api-key", GOOD_KEY], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            first = proc.stdout.readline()
            proc.stdout.close()  # like `head -1` exiting
            gate.set()  # now the CLI writes the next events into a closed pipe
            err = proc.stderr.read()
            code = proc.wait(30)
        finally:
            gate.set()
            if proc.poll() is None:
                proc.kill()
    assert '"event": "started"' in first
    assert (code, err) == (0, "")


def test_abbreviated_flags_are_refused(fake: FakeInference, fake_target: str) -> None:
    run = kvfence("generate", "hi", "--target", fake_target, "--api-key", GOOD_KEY,
                  "--max-token", "5")
    assert run.returncode == 2
    assert "unrecognized arguments: --max-token 5" in run.stderr
    assert _requests(fake) == []


def test_version() -> None:
    run = kvfence("--version")
    assert (run.returncode, run.stdout) == (0, f"kvfence {metadata.version('kvfence')}\n")


def test_unknown_flag_prints_the_subcommands_usage() -> None:
    run = kvfence("usage", "--bogus")
    assert run.returncode == 2
    lines = run.stderr.splitlines()
    assert lines[0].startswith("usage: kvfence usage ")
    assert lines[-1] == "kvfence usage: error: unrecognized arguments: --bogus"


def test_usage_figures_are_rounded(fake: FakeInference, fake_target: str) -> None:
    fake.hit_rate = 0.6044444444444445
    run = kvfence("usage", "--target", fake_target, "--api-key", GOOD_KEY)
    assert run.returncode == 0, run.stderr
    assert "hit_rate: 0.604\n" in run.stdout
    assert "quota.prefix_cache_ttl_s: 600\n" in run.stdout
    exact = kvfence("usage", "--json", "--target", fake_target, "--api-key", GOOD_KEY)
    assert '"hit_rate": 0.6044444444444445' in exact.stdout  # --json keeps the raw figure


def test_missing_key_names_the_flag_and_the_variable(plain_server: RealServer) -> None:
    run = kvfence("usage", "--target", plain_server.target)
    assert run.returncode == 26
    assert run.stdout == ""
    [line] = run.stderr.splitlines()
    assert line.startswith("kvfence: error: UNAUTHENTICATED: missing credentials")
    assert "--api-key" in line and "KVFENCE_API_KEY" in line


def test_wrong_key_says_where_it_came_from(plain_server: RealServer) -> None:
    run = kvfence("usage", "--target", plain_server.target, env={"KVFENCE_API_KEY": "kvf_stale"})
    assert run.returncode == 26
    assert run.stderr == ("kvfence: error: UNAUTHENTICATED: invalid API key "
                          "(the key came from KVFENCE_API_KEY)\n")


def test_client_verbs_ignore_server_only_variables(plain_server: RealServer) -> None:
    server_only = {"KVFENCE_PORT": "abc", "KVFENCE_REFLECTION": "maybe",
                   "KVFENCE_LOG_FORMAT": "xml", "KVFENCE_API_KEY": plain_server.key}
    run = kvfence("usage", "--target", plain_server.target, env=server_only)
    assert run.returncode == 0, run.stderr
    assert "page_size: 16" in run.stdout
    # serve itself still refuses them, naming the variable.
    refused = kvfence("serve", env=server_only)
    assert refused.returncode == 2
    assert "KVFENCE_PORT='abc'" in refused.stderr.splitlines()[-1]


def test_text_mode_says_why_it_stopped(fake: FakeInference, fake_target: str) -> None:
    run = kvfence("generate", "hi", "--target", fake_target, "--api-key", GOOD_KEY,
                  "--max-tokens", "5")
    assert (run.returncode, run.stdout) == (0, "Hello, world\n")
    assert run.stderr == ("kvfence: [stopped: reached --max-tokens 5 (5 tokens); "
                          "raise it for more]\n")
    default = kvfence("generate", "hi", "--target", fake_target, "--api-key", GOOD_KEY)
    assert "reached --max-tokens 16 " in default.stderr  # the server's default, named


def test_chat_asks_for_enough_tokens_for_an_answer(fake: FakeInference, fake_target: str) -> None:
    run = kvfence("chat", "--target", fake_target, "--api-key", GOOD_KEY, input="hello\n")
    assert run.returncode == 0, run.stderr
    [request] = _requests(fake)
    assert request.stopping.max_tokens == 256
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "hello")]


def test_generate_chat_uses_the_chat_template(fake: FakeInference, fake_target: str) -> None:
    run = kvfence("generate", "--chat", "Say hi.", "--target", fake_target, "--api-key", GOOD_KEY)
    assert run.returncode == 0, run.stderr
    [request] = _requests(fake)
    assert request.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "Say hi.")]


def test_help_shows_the_defaults() -> None:
    serve = kvfence("serve", "--help").stdout
    for shown in ("(default: 512MiB)", "(default: 50051)", "(default: auto)",
                  "(default: reassign)", "(default: 10.0)"):
        assert shown in serve
    generate = " ".join(kvfence("generate", "--help").stdout.split())
    assert "most tokens to generate [16]" in generate
    assert "0 = greedy [1.0]" in generate
    assert "(default: 127.0.0.1:50051)" in generate
    chat = " ".join(kvfence("chat", "--help").stdout.split())
    assert "most tokens to generate [16] (default: 256)" in chat
