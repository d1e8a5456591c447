"""gpu.json and gpu.md: every figure the check measured, and pass/miss per requirement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import Target


def targets(result: dict[str, Any], dry_run: bool) -> list[Target]:
    """The issue's requirements as pass/miss lines. The throughput targets are the H200's;
    a dry run records them without holding tiny CPU shapes to them."""
    out: list[Target] = []
    py = result["pytest"]
    out.append(Target("pytest -m cuda failures+errors", py["failures"] + py["errors"], 0, False))
    expected_skips = py["tests"] if dry_run else 0
    out.append(
        Target(
            "pytest -m cuda skipped beyond expected", abs(py["skipped"] - expected_skips), 0, False
        )
    )
    out.append(Target("pytest -m cuda tests run", py["tests"], 1))
    greedy = result["greedy"]
    out.append(
        Target("greedy mismatched tokens", sum(g["mismatched_tokens"] for g in greedy), 0, False)
    )
    over = sum(g["max_logit_error"] > g["logit_error_bound"] for g in greedy)
    out.append(Target("greedy runs over their logit-error bound", over, 0, False))
    graphed = [g for g in greedy if g["run"].endswith("graphed")]
    out.append(
        Target(
            "graphed greedy runs with replays",
            sum(g["graph_replays"] > 0 for g in graphed),
            len(graphed),
        )
    )
    iso = result["isolation"]
    flags = (
        "page_written_by_a_nonzero",
        "page_reused_by_b",
        "zero_when_handed_to_b",
        "rest_of_page_zero_after_b_step",
        "stale_generation_refused",
        "kv_unchanged_by_refusal",
    )
    out.append(Target("isolation checks holding", sum(bool(iso[f]) for f in flags), len(flags)))
    out.append(
        Target(
            "plans or kernels after a refused fence",
            iso["plans_after_refusal"] + iso["kernels_after_refusal"],
            0,
            False,
        )
    )
    if not dry_run:
        rows = {r["batch"]: r for r in result["throughput"]["rows"]}
        if 1 in rows:
            out.append(
                Target(
                    "batch-1 graphed decode, fraction of HBM roofline",
                    rows[1]["kvfence_roofline_fraction"],
                    0.5,
                )
            )
        if 64 in rows:
            out.append(Target("batch-64 throughput / transformers", rows[64]["speedup"], 2.0))
    return out


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"# GPU check ({'dry run, CPU' if meta['dry_run'] else meta['device_name']})",
        "",
        f"torch {meta['torch']}, flashinfer {meta['flashinfer']}, transformers {meta['transformers']}; "
        f"total {meta['seconds']:.1f} s",
        "",
        "| requirement | value | threshold | passed |",
        "| --- | --- | --- | --- |",
    ]
    for t in result["targets"]:
        lines.append(
            f"| {t['name']} | {t['value']:.3g} | {t['threshold']:.3g} | {'yes' if t['passed'] else 'NO'} |"
        )
    lines += [
        "",
        "## Greedy equality vs transformers",
        "",
        "| arch | run | identical | near ties | mismatched tokens | max logit error (bound) "
        "| graph replays |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g in result["greedy"]:
        lines.append(
            f"| {g['arch']} | {g['run']} | {g['identical']}/{g['sequences']} | "
            f"{g['near_ties']} | {g['mismatched_tokens']} | "
            f"{g['max_logit_error']:.2g} ({g['logit_error_bound']:.2g}) | {g['graph_replays']} |"
        )
    tp = result["throughput"]
    lines += [
        "",
        f"## Decode throughput ({tp['backend']}, graphed; bandwidth "
        f"{tp['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s measured by copy)",
        "",
        "| batch | kvfence tok/s | step ms | roofline ms | of roofline | transformers tok/s | of roofline | speedup |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in tp["rows"]:
        lines.append(
            f"| {r['batch']} | {r['kvfence_tokens_per_s']:.1f} | {r['kvfence_step_ms']:.2f} | "
            f"{r['roofline_step_ms']:.2f} | {r['kvfence_roofline_fraction']:.1%} | "
            f"{r['transformers_tokens_per_s']:.1f} | {r['transformers_roofline_fraction']:.1%} | "
            f"{r['speedup']:.2f}x |"
        )
    iso = result["isolation"]
    lines += ["", "## Isolation on device memory", ""]
    lines += [f"- {k}: {v}" for k, v in iso.items()]
    py = result["pytest"]
    lines += [
        "",
        f"## pytest -m cuda: {py['tests']} tests, {py['failures']} failures, "
        f"{py['errors']} errors, {py['skipped']} skipped",
        "",
    ]
    return "\n".join(lines)


def write(out_dir: Path, result: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / "gpu.md").write_text(markdown(result))
