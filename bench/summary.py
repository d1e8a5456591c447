"""Renders a run's suites as markdown: printed by ``bench.run_all``, written to ``summary.md``
for a ``--quick`` run; ``tools.benchmarks_doc`` renders the committed results into
``docs/benchmarks.md`` with the same sections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, fmt_spread, md_table

SUITE_ORDER = (
    "single_stream",
    "offline",
    "overhead",
    "memory",
    "continuous",
    "online",
    "online_http",
    "online_guidellm",
    "prefix",
    "shared_prefix",
    "isolation_cost",
    "lora",
    "tiers",
)


def load_results(out: Path) -> dict[str, dict[str, Any]]:
    found = {}
    for suite in SUITE_ORDER:
        path = out / f"{suite}.json"
        if path.exists():
            found[suite] = json.loads(path.read_text())
    return found


def summary_markdown(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for suite, data in results.items():
        for t in data.get("targets", []):
            goal = ("≥ " if t["higher_is_better"] else "≤ ") + f"{t['threshold']:g}"
            rows.append(
                (
                    suite,
                    t["name"],
                    f"{t['value']:.3f}",
                    goal,
                    "pass" if t["passed"] else "MISS",
                    f"{t['margin']:+.3f}",
                )
            )
    parts = [
        "## Targets",
        md_table(("suite", "target", "measured", "goal", "result", "margin"), rows),
    ]
    single = results.get("single_stream")
    if single:
        parts += [
            "## Single-stream decode (median [min–max] of runs)",
            md_table(
                ("system", "TTFT ms", "decode tok/s"),
                [
                    (name, _spread(f["ttft_ms"]), _spread(f["decode_tok_s"]))
                    for name, f in single["systems"].items()
                ],
            ),
        ]
    offline = results.get("offline")
    if offline:
        parts += [
            "## Offline throughput (output tok/s, median [min–max])",
            md_table(
                ("system", "output tok/s", "total tok/s"),
                [
                    (name, _spread(f["output_tok_s"]), _spread(f["total_tok_s"]))
                    for name, f in offline["systems"].items()
                ]
                if "systems" in offline
                else [(r["system"], r["output_tok_s"], r["total_tok_s"]) for r in offline["runs"]],
            ),
        ]
        parts += llama_sections(offline)
    # NOTE: a section is shown only from results that carry runs (median [min–max]); an
    # older single-run results file is left out rather than shown without its spread.
    memory = results.get("memory")
    if memory and "figures" in memory:
        parts += [
            "## Memory per weights mode (median [min–max] of fresh processes)",
            md_table(
                ("--weights", "RSS after load MB", "peak RSS MB", "packed copies MB",
                 "decode tok/s (1 stream)"),
                [
                    (mode, *(_spread(f[k]) for k in ("rss_after_load_mb", "peak_rss_mb",
                                                      "packed_mb", "decode_tok_s")))
                    for mode, f in memory["figures"].items()
                ],
            ),
        ]
    overhead = results.get("overhead")
    if overhead and _has_runs(overhead.get("points", [{}])[0].get("engine_step_ms")):
        parts += [
            "## Engine step overhead (median [min–max] of runs)",
            md_table(
                ("B", "context", "engine step ms", "raw forward ms", "raw / engine"),
                [
                    (
                        p["batch"],
                        p["context"],
                        _spread(p["engine_step_ms"]),
                        _spread(p["raw_forward_ms"]),
                        _spread(p["ratio_raw_over_engine"]),
                    )
                    for p in overhead["points"]
                ],
            ),
        ]
    cont = results.get("continuous")
    if cont and _has_runs(cont.get("speedup")):
        parts.append(
            f"Continuous batching is **{_spread(cont['speedup'])}x** static batching "
            f"(max batch {cont['max_batch']}; median [min–max] of runs paired by run)."
        )
    online = results.get("online")
    if online and "rates" in online:
        parts += [
            "## Online serving (gRPC; median [min–max] of runs)",
            md_table(
                (
                    "rate",
                    "req/s",
                    "out tok/s",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "ITL p50 ms",
                    "ITL p99 ms",
                ),
                [
                    (
                        r["rate"],
                        *(
                            _spread(r["overall"][k])
                            for k in (
                                "req_s",
                                "output_tok_s",
                                "ttft_p50_ms",
                                "ttft_p99_ms",
                                "itl_p50_ms",
                                "itl_p99_ms",
                            )
                        ),
                    )
                    for r in online["rates"]
                ],
            ),
        ]
    prefix = results.get("prefix")
    if prefix and "ttft_ms" in prefix:
        parts += [
            "## Prefix cache TTFT (median [min–max] of repetitions)",
            md_table(
                ("request", "TTFT ms", "/ cold", "max cached tokens"),
                [
                    (k, _spread(v), _spread(prefix["ttft_over_cold"][k]), prefix["cached_tokens"][k])
                    for k, v in prefix["ttft_ms"].items()
                ],
            ),
        ]
    shared = results.get("shared_prefix")
    if shared and "figures" in shared:
        from bench.shared_prefix import shared_table, tier_table

        parts += [
            "## Shared prefix and KV tier (median [min–max] of runs)",
            shared_table(shared["figures"]),
            tier_table(shared["figures"]),
        ]
    iso = results.get("isolation_cost")
    if iso and "output_tok_s" in iso:
        parts += [
            "## Isolation cost (median [min–max] of rounds)",
            md_table(
                ("isolation work in the default run", "median [min–max]"),
                [(k, _spread(v)) for k, v in iso.get("isolation_work", {}).items()],
            ),
            md_table(
                ("configuration", "output tok/s"),
                [(k, _spread(v)) for k, v in iso["output_tok_s"].items()],
            ),
            md_table(
                ("throughput difference (paired by round)", "1 - default / alternative"),
                [(k, _spread(v)) for k, v in iso["overhead"].items()],
            ),
        ]
    any_data = next(iter(results.values()), None)
    if any_data:
        m = any_data["machine"]
        flags = ", ".join(f for f, on in m["cpu_flags"].items() if on)
        versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
        parts.append(
            f"Machine: {m['cpu_model']}, {m['usable_cores']} cores, {m['threads']} threads; "
            f"flags: {flags}; {versions}."
        )
    errors = [
        f"- {s}: {k}: {v}" for s, d in results.items() for k, v in d.get("errors", {}).items()
    ]
    if errors:
        parts += ["## Errors", "\n".join(errors)]
    return "\n\n".join(parts)


def llama_sections(offline: dict[str, Any]) -> list[str]:
    """The offline suite's llama.cpp settings: the llama-server sweep, llama-batched-bench."""
    parts = []
    sweep = offline.get("llama_server_sweep")
    if sweep:
        ranked = sorted(sweep.items(), key=lambda kv: -kv[1])
        parts += [
            "llama-server sweep, one run per setting on a quarter of the work (the fastest is "
            "the one timed above):",
            md_table(("setting", "output tok/s"), ranked),
        ]
    batched = offline.get("llama_batched_bench")
    if batched:
        parts += [
            f"llama-batched-bench, {batched[0]['prompt']}-token prompts and {batched[0]['output']} "
            "output tokens per sequence (raw batched prefill then decode, no server):",
            md_table(("parallel", "decode tok/s (S_TG)", "output tok/s incl. prefill"),
                     [(b["parallel"], b["decode_tok_s"], b["output_tok_s"]) for b in batched]),
        ]
    return parts


def _spread(s: dict[str, float]) -> str:
    return fmt_spread(s)


def _has_runs(figure: Any) -> bool:
    return isinstance(figure, dict) and "runs" in figure


def write_summary(out: Path, failures: dict[str, str]) -> str:
    results = load_results(out)
    text = summary_markdown(results)
    if failures:
        text += "\n\n## Suites that failed in the last run\n\n" + "\n".join(
            f"- {s}: {msg}" for s, msg in failures.items()
        )
    if out != RESULTS_DIR:  # full runs are rendered into docs/benchmarks.md instead
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text(text + "\n")
    return text
