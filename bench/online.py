"""Suite 4, online serving through gRPC, in the style of vLLM `bench serve`.

200 requests per run, 3 tenants (round robin), random token prompts of 128 and outputs of 64
tokens with range ratio 0.5 (uniform in [64, 192] and [32, 96]), greedy, ignore_eos.
First an unlimited-rate run capped at 32 concurrent requests measures capacity C (req/s);
then Poisson arrivals at RATE_FRACTIONS of C. Rates are set relative to the measured
capacity so the curve spans light load to near saturation on any machine; the absolute
rates are recorded. The whole plan is run RUNS times at the rates the first capacity run set;
every figure is the median [min–max] of its runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import numpy as np

from bench.common import (
    RUNS,
    bench_threads,
    default_model_file,
    line_plot,
    machine_info,
    md_table,
    random_work,
    results_dir,
    set_torch_threads,
    spreads,
    write_suite,
)
from bench.traces import by_tenant, summarize

SUITE = "online"
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
RATE_FRACTIONS = (0.5, 0.7, 0.9)
MAX_CONCURRENCY = 32
FIGURES = (
    "req_s",
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
)


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return [float(x) for x in np.cumsum(gaps) - gaps[0]]


async def _runs(loaded: Any, quick: bool) -> list[dict[str, Any]]:
    from bench.kvfence_runner import check_complete, grpc_server, run_grpc

    n, inp, out = (12, 32, 8) if quick else (200, 128, 64)
    vocab = loaded.model.config.vocab_size
    work = random_work(0, n, (inp // 2, inp * 3 // 2), (out // 2, out * 3 // 2), vocab)
    warm = random_work(1, 6, (inp // 2, inp), (2, 4), vocab)
    results: list[dict[str, Any]] = []
    async with grpc_server(loaded, TENANTS) as (target, keys, _):
        await run_grpc(target, keys, warm, TENANTS)
        plans: list[tuple[str, float | None]] = [("inf", None)]
        for rep in range(RUNS):
            for i, (label, rate) in enumerate(plans):  # the first capacity run extends plans
                arrivals = poisson_arrivals(rate, n, seed=i) if rate else None
                wall, traces = await run_grpc(
                    target,
                    keys,
                    work,
                    TENANTS,
                    arrivals=arrivals,
                    max_concurrency=None if rate else MAX_CONCURRENCY,
                )
                check_complete(work, traces)
                overall = summarize(traces, wall)
                results.append(
                    {
                        "run": rep,
                        "rate": label,
                        "request_rate": rate,
                        "max_concurrency": None if rate else MAX_CONCURRENCY,
                        "overall": overall,
                        "per_tenant": by_tenant(traces, wall),
                    }
                )
                print(
                    f"[{SUITE}] run {rep} rate={label}: {overall['req_s']:.2f} req/s, "
                    f"{overall['output_tok_s']:.1f} out tok/s, "
                    f"TTFT p50 {overall['ttft_p50_ms']:.0f} ms",
                    flush=True,
                )
                if rate is None and len(plans) == 1:  # capacity known: add the Poisson runs
                    capacity = overall["req_s"]
                    plans += [(f"{f * capacity:.2f}", f * capacity) for f in RATE_FRACTIONS]
    return results


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import Sizing, load_kvfence

    threads = bench_threads()
    out = results_dir(quick)
    set_torch_threads(threads)
    loaded = load_kvfence(default_model_file())
    results = asyncio.run(_runs(loaded, quick))
    cols = (
        "rate",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p50",
        "ITL p99",
    )

    def row(label: str, s: dict[str, Any]) -> tuple[Any, ...]:
        return (label, *(s[k] for k in FIGURES))

    rates = aggregate(results)
    overall = [row(r["rate"], r["overall"]) for r in rates]
    tenants = [row(f"{r['rate']} / {t}", s) for r in rates for t, s in r["per_tenant"].items()]
    ordered = sorted(rates, key=lambda r: r["overall"]["req_s"].median)
    x = [r["overall"]["req_s"].median for r in ordered]
    plots = [
        line_plot(
            out,
            f"{SUITE}_ttft",
            x,
            {q: [r["overall"][f"ttft_{q}_ms"].median for r in ordered] for q in ("p50", "p99")},
            "TTFT vs request rate",
            "achieved req/s",
            "TTFT ms",
        ),
        line_plot(
            out,
            f"{SUITE}_itl",
            x,
            {q: [r["overall"][f"itl_{q}_ms"].median for r in ordered] for q in ("p50", "p99")},
            "ITL vs request rate",
            "achieved req/s",
            "ITL ms",
        ),
    ]
    md = "\n\n".join(
        [
            f"# Online serving over gRPC{' (quick)' if quick else ''}",
            f"{results[0]['overall']['requests']} requests per run, tenants {', '.join(TENANTS)}; "
            f"rate `inf` = all at once, at most {MAX_CONCURRENCY} in flight; the other rates are "
            f"Poisson at {', '.join(str(f) for f in RATE_FRACTIONS)} x its req/s (set by the "
            f"first run). Every figure: median [min–max] of {RUNS} runs. Times in ms; "
            f"{threads} threads.",
            md_table(cols, overall),
            "## Per tenant",
            md_table(cols, tenants),
            *(f"![plot]({p})" for p in plots),
        ]
    )
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "kvfence_sizing": asdict(Sizing()),
        "runs": results,
        "rates": rates,
        "targets": [],
    }
    write_suite(out, SUITE, data, md)
    return data


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per rate (in first-run order): each figure as a Spread over that rate's runs,
    overall and per tenant."""
    by_rate: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_rate.setdefault(r["rate"], []).append(r)
    return [
        {
            "rate": label,
            "request_rate": runs[0]["request_rate"],
            "runs": len(runs),
            "overall": spreads([r["overall"] for r in runs], FIGURES),
            "per_tenant": {
                t: spreads([r["per_tenant"][t] for r in runs], FIGURES)
                for t in runs[0]["per_tenant"]
            },
        }
        for label, runs in by_rate.items()
    ]
