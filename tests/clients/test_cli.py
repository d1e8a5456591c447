from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading

import grpc
import pytest

from clients import cli
from clients.errors import error_for
from protos.kvfence.v1 import inference_pb2
from tests.clients.conftest import repo_root
from tests.clients.fakeserver import GOOD_KEY, Fail, FakeInference, serve


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_text_as_it_arrives() -> None:
    """Chunk 1 reaches our pipe while the server still holds chunk 2 (nothing is buffered)."""
    gate = threading.Event()
    fake = FakeInference(gate=gate)
    with serve(fake) as target:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clients.cli",
                "generate",
                "hi",
                "--target",
                target,
                "--max-tokens",
                "5",
            ],
            cwd=repo_root(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "KVFENCE_API_KEY": GOOD_KEY},
        )
        try:
            assert proc.stdout is not None
            first = proc.stdout.read(3)
            held = not gate.is_set() and fake.cancelled == []
            gate.set()
            out, err = proc.communicate(timeout=30)
        finally:
            gate.set()
            if proc.poll() is None:
                proc.kill()
    assert first == b"Hel" and held
    assert (proc.returncode, first + out) == (0, b"Hello, world\n")
    assert err == b"kvfence: [stopped: reached --max-tokens 5 (5 tokens); raise it for more]\n"


def test_bad_key_prints_one_line_and_exits_with_the_status_code(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["generate", "hi", "--target", target, "--api-key", "bad"], capsys)
    assert (code, out, err) == (26, "", "kvfence: error: UNAUTHENTICATED: invalid API key "
                                        "(the key came from --api-key)\n")


def test_api_key_and_target_come_from_the_environment(
    fake: FakeInference,
    target: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVFENCE_API_KEY", GOOD_KEY)
    monkeypatch.setenv("KVFENCE_TARGET", target)
    assert run(["purge"], capsys) == (0, "purged 5 pages\n", "")


def test_exit_codes_are_distinct_per_status() -> None:
    codes = [c for c in grpc.StatusCode if c != grpc.StatusCode.OK]
    exits = [cli.exit_code(error_for(c, "m")) for c in codes]
    assert len(set(exits)) == len(codes)
    assert exits == [10 + c.value[0] for c in codes]
    assert not {0, 1, 2, 130} & set(exits)
    assert cli.exit_code(ValueError("local")) == 1


def test_server_errors_mid_stream(
    fake: FakeInference, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.failures = [Fail(grpc.StatusCode.PERMISSION_DENIED, "model not allowed")]
    code, _, err = run(["generate", "hi", "--target", target, "--api-key", GOOD_KEY], capsys)
    assert (code, err) == (17, "kvfence: error: PERMISSION_DENIED: model not allowed\n")


def test_local_errors_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["usage", "--target", "127.0.0.1:1", "--tls-ca", "/nope/ca.pem"], capsys)
    assert (code, out) == (1, "")
    assert (
        err == "kvfence: error: cannot read CA certificate '/nope/ca.pem': "
        "No such file or directory\n"
    )


def test_generate_flags_reach_the_request(
    fake: FakeInference, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(
        [
            "generate",
            "hi",
            "--target",
            target,
            "--api-key",
            GOOD_KEY,
            "--max-tokens",
            "9",
            "--temperature",
            "0",
            "--top-p",
            "0.5",
            "--top-k",
            "4",
            "--seed",
            "11",
            "--stop",
            "a",
            "--stop",
            "b",
            "--timeout",
            "30",
            "--model",
            "sql",
        ],
        capsys,
    )
    assert (code, out) == (0, "Hello, world\n")
    sent = fake.seen.requests[0]
    assert isinstance(sent, inference_pb2.GenerateRequest)
    assert (sent.text, sent.stopping.max_tokens, list(sent.stopping.stop)) == ("hi", 9, ["a", "b"])
    assert sent.model == "sql"
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0
    assert (sent.sampling.top_p, sent.sampling.top_k, sent.sampling.seed) == (0.5, 4, 11)
    timeout = fake.seen.timeouts[0]
    assert timeout is not None and 29 < timeout <= 30.5  # grpc rounds deadlines; a few ms either way


def test_generate_json_prints_one_object_per_event(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(
        ["generate", "hi", "--json", "--target", target, "--api-key", GOOD_KEY], capsys
    )
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [e["event"] for e in events] == ["started"] + ["chunk"] * 5 + ["finished"]
    assert "".join(e["text"] for e in events if e["event"] == "chunk") == "Hello, world"
    assert events[-1]["reason"] == "length"
    assert events[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "cached_prompt_tokens": 1,
    }


def test_chat_keeps_history_and_stops_at_exit(
    fake: FakeInference,
    target: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\nagain\n/exit\nnot sent\n"))
    code, out, err = run(["chat", "--system", "be brief", "--target", target,
                          "--api-key", GOOD_KEY], capsys)
    assert (code, out) == (0, "Hello, world\nHello, world\n")
    assert err == "kvfence: [stopped: reached --max-tokens 256 (5 tokens); raise it for more]\n" * 2
    turns = [[(m.role, m.content) for m in r.chat.messages]
             for r in fake.seen.requests if isinstance(r, inference_pb2.GenerateRequest)]
    assert turns == [
        [("system", "be brief"), ("user", "hello")],
        [
            ("system", "be brief"),
            ("user", "hello"),
            ("assistant", "Hello, world"),
            ("user", "again"),
        ],
    ]


def test_chat_ends_at_eof(
    fake: FakeInference,
    target: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("only turn"))
    code, out, _ = run(["chat", "--target", target, "--api-key", GOOD_KEY], capsys)
    assert (code, out, fake.generate_calls) == (0, "Hello, world\n", 1)


def test_tokenize_usage_purge(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--target", target, "--api-key", GOOD_KEY]
    assert run(["tokenize", "a bb ccc", *common], capsys) == (0, "1 2 3\n", "")
    code, out, _ = run(["tokenize", "a bb", "--json", *common], capsys)
    assert json.loads(out) == {"token_ids": [1, 2], "tokens": ["a", "bb"]}
    code, out, _ = run(["usage", *common], capsys)
    assert code == 0
    assert out.splitlines()[:3] == ["pages_in_use: 2", "pages_cached: 5", "cached_prefixes: 1"]
    assert "quota.max_kv_pages: 100" in out.splitlines()
    code, out, _ = run(["usage", "--json", *common], capsys)
    assert json.loads(out)["quotas"]["max_concurrent_streams"] == 4
    assert run(["purge", *common], capsys) == (0, "purged 5 pages\n", "")


def test_register_plugs_into_a_foreign_parser() -> None:
    parser = argparse.ArgumentParser(prog="kvfence")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve")  # the service's own verbs live next to ours
    cli.register(sub)
    args = parser.parse_args(["generate", "hi", "--stop", "x", "--stop", "y"])
    assert callable(args.func) and args.stop == ["x", "y"]
    assert args.target == "127.0.0.1:50051" and args.api_key is None
    for verb in ("chat", "tokenize", "usage", "purge"):
        argv = [verb, "t"] if verb == "tokenize" else [verb]
        assert callable(parser.parse_args(argv).func)


def test_retried_failures_still_print_exactly_one_line(fake: FakeInference, target: str) -> None:
    # A real process: under pytest, log records are captured and would never reach stderr.
    fake.failures = [Fail(grpc.StatusCode.UNAVAILABLE, "draining")] * 4
    proc = subprocess.run(
        [sys.executable, "-m", "clients.cli", "tokenize", "a", "--target", target],
        cwd=repo_root(),
        env={**os.environ, "KVFENCE_API_KEY": GOOD_KEY},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert len(fake.seen.requests) == 4  # the default policy: four attempts
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        24,
        "",
        "kvfence: error: UNAVAILABLE: draining\n",
    )
