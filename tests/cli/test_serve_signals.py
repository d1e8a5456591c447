"""Ctrl-C and SIGTERM end `kvfence serve` at once while it loads or warms up."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cli.conftest import ROOT, clean_env, free_port
from tests.serverutil import TenantSpec, write_tenants_file


@pytest.mark.parametrize(("signum", "stage", "code"), [
    (signal.SIGINT, '"event": "model.loading"', 130),
    pytest.param(signal.SIGTERM, '"event": "engine.starting"', 0, marks=pytest.mark.slow),
])
def test_signal_during_start_up_exits_at_once(signum: int, stage: str, code: int,
                                              tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    write_tenants_file(tenants, {"acme": TenantSpec()})
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.serve.commands", "serve", "--tenants", str(tenants), "--port",
         str(free_port()), "--log-format", "json", "--kv-memory", "64MiB"],
        cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    reached = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if stage in line:
                reached.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert reached.wait(300), "".join(seen)
        proc.send_signal(signum)
        sent = time.monotonic()
        rc = proc.wait(60)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stdout is not None
    assert proc.stdout.read() == ""  # never served
    assert rc == code
    assert elapsed < 5.0, f"took {elapsed:.1f}s to stop"
    time.sleep(0.2)
    assert seen[-1] == "kvfence: stopped during start-up; nothing was served\n"
    assert not any('"engine_warmup_done"' in line for line in seen)
