"""Suite 4, online serving through gRPC, in the style of vLLM `bench serve`.

200 requests per run, 3 tenants (round robin), random token prompts of 128 and outputs of 64
tokens with range ratio 0.5 (uniform in [64, 192] and [32, 96]), greedy, ignore_eos.
First an unlimited-rate run capped at 32 concurrent requests measures capacity C (req/s);
then Poisson arrivals at RATE_FRACTIONS of C. Rates are set relative to the measured
capacity so the curve spans light load to near saturation on any machine; the absolute
rates are recorded. The whole plan is run RUNS times, each run at fractions of its own
capacity run's C; every figure is the median [min–max] of its runs. Target: the inter-token
p50 at 0.9 x capacity at most 40 ms, on the worst run. Every request bypasses the prefix
cache: the same prompts repeat in every run and rate, and hits on them would skip their
prefill, so the later runs and rates would see mostly cached prompts while each run's
capacity run saw few.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import numpy as np

from bench.common import (
    RUNS,
    Target,
    bench_threads,
    default_model_file,
    line_plot,
    machine_info,
    md_table,
    random_work,
    results_dir,
    set_torch_threads,
    spreads,
    targets_table,
    worst_target,
    write_suite,
)
from bench.traces import by_tenant, summarize

SUITE = "online"
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
RATE_FRACTIONS = (0.5, 0.7, 0.9)
MAX_CONCURRENCY = 32
ITL_TARGET_FRACTION, ITL_P50_TARGET_MS = 0.9, 40.0
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


def rate_label(fraction: float | None) -> str:
    """A plan entry's label: ``inf`` for the capacity run, else its fraction of capacity."""
    return "inf" if fraction is None else f"{fraction:g}x"


async def _runs(loaded: Any, quick: bool) -> list[dict[str, Any]]:
    from bench.kvfence_runner import check_complete, grpc_server, run_grpc

    n, inp, out = (12, 32, 8) if quick else (200, 128, 64)
    vocab = loaded.model.config.vocab_size
    work = random_work(0, n, (inp // 2, inp * 3 // 2), (out // 2, out * 3 // 2), vocab)
    warm = random_work(1, 6, (inp // 2, inp), (2, 4), vocab)
    results: list[dict[str, Any]] = []
    async with grpc_server(loaded, TENANTS) as (target, keys, _):
        await run_grpc(target, keys, warm, TENANTS, bypass_prefix_cache=True)
        for rep in range(RUNS):
            # Each run measures its own capacity first and sets its Poisson rates from it: this
            # VM's speed drifts (up to 2x within minutes), and a rate set by an earlier, faster
            # run's capacity would load a slower one past its own.
            capacity = 0.0
            for i, fraction in enumerate((None, *RATE_FRACTIONS)):
                label, rate = rate_label(fraction), None if fraction is None else fraction * capacity
                arrivals = poisson_arrivals(rate, n, seed=i) if rate else None
                wall, traces = await run_grpc(
                    target,
                    keys,
                    work,
                    TENANTS,
                    arrivals=arrivals,
                    max_concurrency=None if rate else MAX_CONCURRENCY,
                    bypass_prefix_cache=True,
                )
                check_complete(work, traces)
                overall = summarize(traces, wall)
                if fraction is None:
                    capacity = overall["req_s"]
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
                    f"[{SUITE}] run {rep} rate={label} "
                    f"({'unlimited' if rate is None else f'{rate:.2f} req/s'}): "
                    f"{overall['req_s']:.2f} req/s, {overall['output_tok_s']:.1f} out tok/s, "
                    f"TTFT p50 {overall['ttft_p50_ms']:.0f} ms, ITL p50 {overall['itl_p50_ms']:.1f} ms",
                    flush=True,
                )
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
    targets = itl_targets(rates)
    overall = [row(_with_rates(r), r["overall"]) for r in rates]
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
            f"Poisson at {', '.join(str(f) for f in RATE_FRACTIONS)} x the req/s of the same "
            f"run's `inf` (each run sets its own; the req/s offered are in brackets). Every "
            f"figure: median [min–max] of {RUNS} runs. Times in ms; {threads} threads.",
            md_table(cols, overall),
            targets_table(targets),
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
        "targets": targets,
    }
    write_suite(out, SUITE, data, md)
    return data


def itl_targets(rates: list[dict[str, Any]]) -> list[Target]:
    """The online target: ITL p50 at 0.9 x capacity, judged on the worst run."""
    label = rate_label(ITL_TARGET_FRACTION)
    return [
        worst_target(
            f"online ITL p50 at {label} capacity, ms",
            r["overall"]["itl_p50_ms"],
            ITL_P50_TARGET_MS,
            higher_is_better=False,
        )
        for r in rates
        if r["rate"] == label
    ]


def _with_rates(r: dict[str, Any]) -> str:
    offered = [x for x in r["request_rates"] if x is not None]
    if not offered:
        return str(r["rate"])
    return f"{r['rate']} ({min(offered):.2f}–{max(offered):.2f})"


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per rate (in first-run order): each figure as a Spread over that rate's runs,
    overall and per tenant."""
    by_rate: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_rate.setdefault(r["rate"], []).append(r)
    return [
        {
            "rate": label,
            "request_rates": [r["request_rate"] for r in runs],
            "runs": len(runs),
            "overall": spreads([r["overall"] for r in runs], FIGURES),
            "per_tenant": {
                t: spreads([r["per_tenant"][t] for r in runs], FIGURES)
                for t in runs[0]["per_tenant"]
            },
        }
        for label, runs in by_rate.items()
    ]
