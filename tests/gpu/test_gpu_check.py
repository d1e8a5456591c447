"""``tools/gpu_check.py --dry-run``: the GPU check's own code, run on CPU with tiny shapes, so
the script ``make gpu-check`` runs on a device cannot rot between device runs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools.gpu import report
from tools.gpu.plan import GREEDY_ARCHS, dry_run_plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("gpu")
    proc = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu.json").read_text()), out


@pytest.mark.slow
def test_every_requirement_passes(dry_run: tuple[dict[str, Any], Path]) -> None:
    result, out = dry_run
    assert result["meta"]["dry_run"] is True and result["meta"]["device"] == "cpu"
    assert result["targets"] and all(t["passed"] for t in result["targets"])
    md = (out / "gpu.md").read_text()
    assert "| batch | kvfence tok/s |" in md and "Greedy equality" in md
    assert "step isolation" in (out / "gpu.log").read_text()


def test_cuda_tests_were_collected_and_skipped(dry_run: tuple[dict[str, Any], Path]) -> None:
    py = dry_run[0]["pytest"]
    assert py["tests"] >= 10 and py["skipped"] == py["tests"]
    assert py["failures"] == py["errors"] == 0


def test_greedy_covers_every_arch_and_run(dry_run: tuple[dict[str, Any], Path]) -> None:
    plan = dry_run_plan()
    greedy = dry_run[0]["greedy"]
    assert {(g["arch"], g["run"]) for g in greedy} == {
        (a, r.name) for a in GREEDY_ARCHS for r in plan.greedy_runs
    }
    for g in greedy:
        assert g["identical"] == g["sequences"] == plan.greedy_prompts
        assert 0 <= g["max_logit_error"] <= g["logit_error_bound"] == 1e-3
        steps = plan.greedy_new_tokens - 1
        assert g["graph_replays"] == (steps if g["run"].endswith("graphed") else 0)


def test_throughput_rows_are_consistent(dry_run: tuple[dict[str, Any], Path]) -> None:
    tp = dry_run[0]["throughput"]
    plan = dry_run_plan()
    assert [r["batch"] for r in tp["rows"]] == list(plan.batches)
    for r in tp["rows"]:
        assert r["kvfence_graph_replays"] == r["kvfence_decode_steps"] == plan.new_tokens - 1
        # fraction of roofline == roofline step time / measured step time
        assert r["kvfence_roofline_fraction"] == pytest.approx(
            r["roofline_step_ms"] / r["kvfence_step_ms"]
        )
        assert r["speedup"] == pytest.approx(
            r["kvfence_tokens_per_s"] / r["transformers_tokens_per_s"]
        )


def test_isolation_on_the_check_device(dry_run: tuple[dict[str, Any], Path]) -> None:
    iso = dry_run[0]["isolation"]
    assert iso["zero_when_handed_to_b"] and iso["page_written_by_a_nonzero"]
    assert iso["stale_generation_refused"] and iso["kv_unchanged_by_refusal"]
    assert iso["plans_after_refusal"] == iso["kernels_after_refusal"] == 0


def test_targets_fail_when_a_property_is_off(dry_run: tuple[dict[str, Any], Path]) -> None:
    base = dry_run[0]

    def missed(mutate: Any, dry: bool = True) -> list[str]:
        r = copy.deepcopy(base)
        mutate(r)
        return [t.name for t in report.targets(r, dry) if not t.passed]

    assert missed(lambda r: r["greedy"][0].update(mismatched_tokens=3)) == [
        "greedy mismatched tokens"
    ]
    assert missed(lambda r: r["greedy"][1].update(max_logit_error=0.5)) == [
        "greedy runs over their logit-error bound"
    ]
    assert missed(lambda r: r["isolation"].update(zero_when_handed_to_b=False)) == [
        "isolation checks holding"
    ]
    assert missed(lambda r: r["pytest"].update(failures=1)) == ["pytest -m cuda failures+errors"]

    # On a device, the throughput targets count. The rows are pinned below both targets (the
    # dry run's own tiny-shape figures vary with the CPU and may pass either one by chance).
    def on_device(r: dict[str, Any]) -> None:
        r["throughput"]["rows"] = [
            dict(row, batch=b, kvfence_roofline_fraction=0.1, speedup=1.0)
            for row, b in zip(r["throughput"]["rows"], (1, 64), strict=True)
        ]
        r["pytest"]["skipped"] = 0

    assert set(missed(on_device, dry=False)) == {
        "batch-1 graphed decode, fraction of HBM roofline",
        "batch-64 throughput / transformers",
    }
    # ... and the same rows at the targets pass them.
    def at_targets(r: dict[str, Any]) -> None:
        on_device(r)
        r["throughput"]["rows"] = [
            dict(row, kvfence_roofline_fraction=0.5, speedup=2.0) for row in r["throughput"]["rows"]
        ]

    assert not {"batch-1 graphed decode, fraction of HBM roofline",
                "batch-64 throughput / transformers"} & set(missed(at_targets, dry=False))
