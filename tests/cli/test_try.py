"""`make serve`'s "Try:" command prints a complete, sensible sentence with the default model."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cli.conftest import ROOT, clean_env, free_port
from tests.serverutil import SERVING_RE


@pytest.mark.slow
def test_try_command_answers_with_a_sentence(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.serve.dev", "--tenants", str(tmp_path / "tenants.toml"),
         "--port", str(port), "--kv-memory", "64MiB"],
        cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    serving = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if SERVING_RE.match(line):
                serving.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 600
        while not serving.wait(0.5):
            assert proc.poll() is None and time.monotonic() < deadline, "\n".join(lines)
        assert lines[0].endswith("Once it is serving, try:")
        command = shlex.split(lines[1])
        first = subprocess.run(command, env=clean_env(), capture_output=True, text=True,
                               timeout=300)
        again = subprocess.run([*command, "--json"], env=clean_env(), capture_output=True,
                               text=True, timeout=300)
    finally:
        proc.terminate()
        proc.wait(60)
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""  # no "[stopped: ...]": it ended by itself, not at a limit
    answer = first.stdout.strip()
    assert "\n" not in answer and len(answer.split()) >= 5
    assert re.fullmatch(r"[A-Z][^\n]*[.!?]", answer), answer
    events = [json.loads(line) for line in again.stdout.splitlines()]
    assert events[-1]["reason"] == "stop"  # end of text, well inside --max-tokens
    assert events[-1]["usage"]["completion_tokens"] < 64
