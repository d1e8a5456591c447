"""Suite 6, the cost of isolation: engine throughput with scrubbing and prefix caching toggled.

Three configurations of the in-process engine over the same 3-tenant workload (round robin):
the default (scrub `reassign`, prefix cache on), scrub `off`, and prefix cache off (TTL 0).
The KV pool is kept small (POOL_PAGES) so pages cycle between tenants during a run, and
`reassign` really zeroes pages (the scrub count is recorded). Configurations are interleaved
for at least RUNS rounds: throughput is shown as median [min–max] over the rounds, the
overhead is paired by round, and a target passes only if its worst round passes.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from bench.common import (
    RUNS,
    Spread,
    Target,
    bar_plot,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    random_work,
    results_dir,
    set_torch_threads,
    spread,
    targets_table,
    throughput,
    worst_target,
    write_suite,
)

SUITE = "isolation_cost"
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
POOL_PAGES = 384
DEFAULT = "default (reassign, prefix on)"
ALTERNATIVES = {"scrub reassign vs off": "scrub off", "prefix cache on vs off": "prefix cache off"}


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
    n, outs, rounds = (8, (4, 8), RUNS) if quick else (48, (16, 64), max(3, RUNS))
    work = random_work(0, n, (16, 256), outs, vocab)
    warm = random_work(1, 3, (16, 64), (2, 4), vocab)
    base = Sizing(kv_pages=POOL_PAGES)
    configs = {
        DEFAULT: base,
        "scrub off": replace(base, scrub_policy="off"),
        "prefix cache off": replace(base, prefix_ttl_s=0.0),
    }
    samples: dict[str, list[float]] = {k: [] for k in configs}
    scrubs: dict[str, int] = {}
    for r in range(rounds):
        for name, sizing in configs.items():
            rate, scrubs[name] = _one(loaded, sizing, work, warm)
            samples[name].append(rate)
            print(
                f"[{SUITE}] round {r}: {name}: {rate:.1f} output tok/s, {scrubs[name]} scrubs",
                flush=True,
            )
    tok_s, overhead, targets = judge(samples)
    rows = [(k, tok_s[k], scrubs[k]) for k in configs]
    plot = bar_plot(
        out,
        f"{SUITE}_throughput",
        list(tok_s),
        [v.median for v in tok_s.values()],
        "Throughput with isolation features toggled",
        "output tok/s",
    )
    md = "\n\n".join(
        [
            f"# Isolation cost{' (quick)' if quick else ''}",
            f"{n} requests over {len(TENANTS)} tenants, KV pool {POOL_PAGES} pages; median "
            f"[min–max] of {rounds} interleaved rounds; {threads} threads. Overhead = 1 - "
            f"default / alternative, paired by round; targets use the worst round.",
            md_table(("configuration", "output tok/s", "pages scrubbed (last run)"), rows),
            md_table(("overhead", "1 - default / alternative"), list(overhead.items())),
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
        "output_tok_s": tok_s,
        "scrubs": scrubs,
        "overhead": overhead,
        "targets": targets,
    }
    write_suite(out, SUITE, data, md)
    return data


def judge(
    samples: dict[str, list[float]],
) -> tuple[dict[str, Spread], dict[str, Spread], list[Target]]:
    """Throughput per configuration, each overhead paired by round, and the targets (the
    overhead of the worst round must stay under 3%)."""
    tok_s = {k: spread(v) for k, v in samples.items()}
    overhead = {
        label: spread(
            1 - d / a for d, a in zip(samples[DEFAULT], samples[alt], strict=True)
        )
        for label, alt in ALTERNATIVES.items()
    }
    targets = [
        worst_target(f"isolation overhead: {k}", v, 0.03, higher_is_better=False)
        for k, v in overhead.items()
    ]
    return tok_s, overhead, targets
