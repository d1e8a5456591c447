"""The examples in examples/ run against a server and print what they promise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.clients.conftest import repo_root
from tests.clients.fakeserver import GOOD_KEY, FakeInference


def _run(script: str, target: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVFENCE_TARGET": target, "KVFENCE_API_KEY": GOOD_KEY}
    return subprocess.run(
        [sys.executable, str(repo_root() / "examples" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_generate_sync(fake: FakeInference, target: str) -> None:
    proc = _run("generate_sync.py", target, "Once upon a time")
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        "Hello, world\n[length, 5 tokens]\n",
        "",
    )
    assert [r.text for r in fake.seen.generate_requests()] == ["Once upon a time"]


def test_generate_async(fake: FakeInference, target: str) -> None:
    proc = _run("generate_async.py", target, "a", "b")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.splitlines() == [
        "'a' -> 'Hello, world' (length, 5 tokens)",
        "'b' -> 'Hello, world' (length, 5 tokens)",
    ]
    assert len(fake.seen.requests) == 2
    assert sorted(r.text for r in fake.seen.generate_requests()) == ["a", "b"]


@pytest.mark.parametrize("script", ["generate_sync.py", "generate_async.py"])
def test_examples_fail_cleanly_on_a_bad_key(target: str, script: str) -> None:
    env = {**os.environ, "KVFENCE_TARGET": target, "KVFENCE_API_KEY": "bad"}
    proc = subprocess.run(
        [sys.executable, str(repo_root() / "examples" / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        1,
        "",
        "error: UNAUTHENTICATED: invalid API key\n",
    )
