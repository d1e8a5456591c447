"""Suite 6, the cost of isolation: engine throughput with scrubbing and prefix caching toggled.

Three configurations of the in-process engine over the same 3-tenant workload (round robin):
the default (scrub `reassign`, prefix cache on), scrub `off`, and prefix cache off (TTL 0).
The KV pool is kept small (POOL_PAGES) so pages cycle between tenants during a run, and
`reassign` really zeroes pages (the scrub count is recorded). Configurations are interleaved
for ROUNDS rounds and each one's median throughput is used, to damp machine noise.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import replace
from typing import Any

from bench.common import (
    Target,
    bar_plot,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    random_work,
    results_dir,
    set_torch_threads,
    targets_table,
    throughput,
    write_suite,
)

SUITE = "isolation_cost"
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
POOL_PAGES = 384


def _one(loaded: Any, sizing: Any, work: list[Any], warm: list[Any]) -> tuple[float, int]:
    from bench.kvfence_runner import check_complete, run_engine, started_engine

    with started_engine(loaded, sizing) as engine:
        asyncio.run(run_engine(engine, warm, TENANTS))
        before = asyncio.run(engine.stats()).cache.scrubs
        wall, traces = asyncio.run(run_engine(engine, work, TENANTS))
        scrubs = asyncio.run(engine.stats()).cache.scrubs - before
    check_complete(work, traces)
    return throughput("", work, wall).output_tok_s, scrubs


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import Sizing, load_kvfence

    threads = bench_threads()
    out = results_dir(quick)
    set_torch_threads(threads)
    loaded = load_kvfence(default_model_file())
    vocab = loaded.model.config.vocab_size
    n, outs, rounds = (8, (4, 8), 1) if quick else (48, (16, 64), 3)
    work = random_work(0, n, (16, 256), outs, vocab)
    warm = random_work(1, 3, (16, 64), (2, 4), vocab)
    base = Sizing(kv_pages=POOL_PAGES)
    configs = {
        "default (reassign, prefix on)": base,
        "scrub off": replace(base, scrub_policy="off"),
        "prefix cache off": replace(base, prefix_ttl_s=0.0),
    }
    samples: dict[str, list[float]] = {k: [] for k in configs}
    scrubs: dict[str, int] = {}
    for r in range(rounds):
        for name, sizing in configs.items():
            tok_s, scrubs[name] = _one(loaded, sizing, work, warm)
            samples[name].append(tok_s)
            print(
                f"[{SUITE}] round {r}: {name}: {tok_s:.1f} output tok/s, {scrubs[name]} scrubs",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in samples.items()}
    default = med["default (reassign, prefix on)"]
    overhead = {
        "scrub reassign vs off": 1 - default / med["scrub off"],
        "prefix cache on vs off": 1 - default / med["prefix cache off"],
    }
    targets = [
        Target(f"isolation overhead: {k}", v, 0.03, higher_is_better=False)
        for k, v in overhead.items()
    ]
    rows = [(k, med[k], scrubs[k], ", ".join(f"{x:.1f}" for x in samples[k])) for k in configs]
    plot = bar_plot(
        out,
        f"{SUITE}_throughput",
        list(med),
        list(med.values()),
        "Throughput with isolation features toggled",
        "output tok/s",
    )
    md = "\n\n".join(
        [
            f"# Isolation cost{' (quick)' if quick else ''}",
            f"{n} requests over {len(TENANTS)} tenants, KV pool {POOL_PAGES} pages; median of "
            f"{rounds} interleaved rounds; {threads} threads. Overhead = 1 - default / alternative.",
            md_table(
                ("configuration", "output tok/s (median)", "pages scrubbed (last run)", "samples"),
                rows,
            ),
            targets_table(targets),
            f"![throughput]({plot})",
        ]
    )
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "pool_pages": POOL_PAGES,
        "samples": samples,
        "median_output_tok_s": med,
        "scrubs": scrubs,
        "overhead": overhead,
        "targets": targets,
    }
    write_suite(out, SUITE, data, md)
    return data
