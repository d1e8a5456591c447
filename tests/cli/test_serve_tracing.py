"""`kvfence serve --otlp-endpoint` with no collector listening: the start banner names the
endpoint, and the failed exports are one structured line, not the exporter's per-batch and
per-retry lines."""

from __future__ import annotations

import json
import time
from pathlib import Path

from clients import Client
from tests.cli.conftest import clean_env, free_port
from tests.serverutil import TenantSpec, start_server_process, write_tenants_file


def test_no_collector_is_one_line_and_the_banner_names_the_endpoint(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    keys = write_tenants_file(tenants, {"acme": TenantSpec()})
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    # Batches every 0.2 s and a 1 s export deadline, so several batches fail within seconds.
    env = clean_env({"OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    process = start_server_process(tiny_llama_dir, tenants, ["--otlp-endpoint", endpoint],
                                   env=env)
    try:
        with Client(process.target, api_key=keys["acme"]) as client:
            for _ in range(4):
                client.generate_text("hello", max_tokens=2, timeout=60)
                time.sleep(1.5)  # each request's spans in a batch of their own
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                "tracing.export_failed" in line for line in process.output):
            time.sleep(0.2)
        time.sleep(3)
    finally:
        process.stop()
    assert f"kvfence: tracing: OTLP spans to {endpoint}" in process.output
    failed = [json.loads(line) for line in process.output if "tracing.export_failed" in line]
    assert len(failed) == 1, process.output
    assert failed[0]["endpoint"] == endpoint and failed[0]["spans_dropped"] > 0
    noise = [line for line in process.output
             if "Failed to export" in line or "Transient error" in line]
    assert noise == []
