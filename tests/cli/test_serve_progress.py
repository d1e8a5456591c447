"""`kvfence serve` says what it is doing: model load, warm-up with a count, then one ready line."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.conftest import clean_env
from tests.serverutil import SERVING_RE, TenantSpec, start_server_process, write_tenants_file


def test_start_up_reports_each_stage_in_order(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    write_tenants_file(tenants, {"acme": TenantSpec()})
    process = start_server_process(tiny_llama_dir, tenants, env=clean_env())
    try:
        lines = list(process.output)
    finally:
        process.stop()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    names = [e["event"] for e in events]
    for stage in ("model.loading", "model_loaded", "engine.starting", "engine_warmup_done"):
        assert stage in names, names
    assert names.index("model.loading") < names.index("model_loaded") < names.index(
        "engine.starting") < names.index("engine_warmup_done")
    progress = [(e["done"], e["total"]) for e in events if e["event"] == "engine.warmup"]
    assert len(progress) >= 3
    total = progress[0][1]
    assert all(t == total for _, t in progress) and progress[-1][0] == total
    assert [d for d, _ in progress] == sorted({d for d, _ in progress})  # strictly increasing
    [ready] = [i for i, line in enumerate(lines) if SERVING_RE.match(line)]
    warmed = next(i for i, line in enumerate(lines) if '"engine_warmup_done"' in line)
    assert warmed < ready  # one ready line, once warm
