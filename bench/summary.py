"""Collects every suite's results/<suite>.json into summary.md and README.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import fmt_spread, md_table

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
    "isolation_cost",
)

README_HEAD = """# Benchmark results

Produced by `make bench` (`python -m bench.run_all`; `--quick` writes a smoke-sized run to
`quick/`, `--only SUITE` reruns one suite). Each suite writes `<suite>.json` (all numbers plus
the machine: CPU model and flags, cores, library versions, thread counts), `<suite>.md` and
PNG plots. Every system uses the same model (SmolLM2-135M-Instruct, the default Q4_1 GGUF),
all cores as threads, and runs alone after its own warm-up pass.

| suite | what it measures |
|---|---|
| [single_stream](single_stream.md) | one request at a time (32-token prompt, 128 tokens greedy, 3 interleaved runs after a warm-up): TTFT and decode tok/s of kvfence in process (`--weights auto` and `bf16`) and over gRPC, llama.cpp n_seq=1, transformers `generate()`; median [min–max] |
| [offline](offline.md) | 64 requests (seed 0), prompts U[16,256] random ids, outputs U[16,128], greedy, ignore_eos: kvfence engine in process, kvfence over gRPC, transformers `generate()` in static left-padded batches of 8 and 32 (dense weights in kvfence's dtype), llama.cpp batched `llama_decode`: swept over n_seq in {1, 2, 4, 8, 16, 32} x (library defaults; flash attention on with split or unified KV) on a quarter of the work, then its best configuration timed in full. Every system timed 3 times: median [min–max]; ratio targets use kvfence's worst run against the peer's best. |
| [overhead](overhead.md) | engine decode step vs the raw batched forward, B in {1, 8, 32}, context in {128, 512}: 3 runs per point, each the median of 15 steps; median [min–max], target on the worst run |
| [memory](memory.md) | each `--weights` mode (auto, bf16, int8, int4) in a fresh process: RSS after loading the default GGUF, peak RSS after the engine's start and one 128-token stream, the packed copies' size, that stream's decode tok/s; 3 processes per mode, median [min–max] |
| [continuous](continuous.md) | 64 x 128-token prompts, outputs Exponential(mean 64) capped at 256, max batch 16: the engine vs static batches on the same forward; 3 interleaved runs each, median [min–max] |
| [online](online.md) | gRPC, 200 requests, 3 tenants, inputs 128 / outputs 64 (range ratio 0.5): unlimited rate capped at 32 concurrent, then Poisson at 0.5/0.7/0.9 x that capacity; the whole plan 3 times, each run from its own capacity, median [min–max] |
| [online_http](online_http.md) | the same load over the OpenAI HTTP front (`openai` SDK) and gRPC, 3 interleaved rounds (median [min–max]); output tok/s unconstrained vs JSON-schema-constrained |
| [online_guidellm](online_guidellm.md) | GuideLLM (its `concurrent` then `poisson` profiles) on the HTTP front vs the gRPC client on the same prompt texts and output lengths, each load generator in its own process: throughput, TTFT, ITL |
| [prefix](prefix.md) | TTFT of a 1,024-token system prompt: cold, warm (same tenant), other tenant (stays cold); 5 repetitions, median [min–max], target on the worst |
| [isolation_cost](isolation_cost.md) | 3 tenants, 48 requests, a 384-page pool so pages pass between tenants, 3 interleaved rounds: the time the KV manager spends zeroing pages (µs per page x pages zeroed) and in prefix-cache lookups and inserts, over the run's wall time (targets, worst round); engine throughput with scrub off and the prefix cache off, paired by round (figures) |

Sizing: the whole run is meant to take about 20-25 minutes on 2 cores. The request counts
are the ones asked for; repetitions were cut to fit, never below 3 timed runs per figure
(overhead: 3 runs of 15 steps per point; prefix: 5 repetitions; isolation: 3 rounds; online
rates are fractions of each run's own measured capacity so no run waits on a trickle of
arrivals). Every figure is the median [min–max] of its runs, and a target passes only if its
worst run passes. Targets are reported, never asserted.
"""


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
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text + "\n")
    (out / "README.md").write_text(README_HEAD + "\n" + text + "\n")
    return text
