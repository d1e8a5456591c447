"""Suite 5, prefix cache: TTFT of a repeated 1,024-token system prompt over gRPC.

Each repetition purges both tenants' caches, then sends (system prompt + a fresh 16-token
user suffix): tenant A cold, tenant A warm (its own cache hit), tenant B (the same prompt,
which must stay cold: caches are per tenant). TTFT is measured at the client. Figures are the
median [min–max] of the repetitions (at least RUNS); ratios to cold are paired by repetition
and the targets are judged on the worst repetition.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from bench.common import (
    FIRST_PLAIN_TOKEN,
    RUNS,
    Spread,
    Target,
    bar_plot,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    results_dir,
    set_torch_threads,
    spread,
    targets_table,
    worst_target,
    write_suite,
)

SUITE = "prefix"
TENANTS = ("tenant-a", "tenant-b")
SUFFIX = 16


async def _measure(loaded: Any, system_len: int, reps: int) -> dict[str, list[tuple[float, int]]]:
    from bench.kvfence_runner import grpc_server, ttft_and_cached
    from clients.aio import AsyncClient

    rng = np.random.default_rng(0)
    vocab = loaded.model.config.vocab_size
    system = [int(t) for t in rng.integers(FIRST_PLAIN_TOKEN, vocab, size=system_len)]

    def prompt() -> list[int]:
        return system + [int(t) for t in rng.integers(FIRST_PLAIN_TOKEN, vocab, size=SUFFIX)]

    out: dict[str, list[tuple[float, int]]] = {"cold": [], "warm": [], "other tenant": []}
    async with grpc_server(loaded, TENANTS) as (target, keys, _):
        a, b = (AsyncClient(target, api_key=keys[t], retries=0) for t in TENANTS)
        try:
            await ttft_and_cached(a, [int(t) for t in rng.integers(FIRST_PLAIN_TOKEN, vocab, size=64)])
            for _ in range(reps):
                await a.purge()
                await b.purge()
                out["cold"].append(await ttft_and_cached(a, prompt()))
                out["warm"].append(await ttft_and_cached(a, prompt()))
                out["other tenant"].append(await ttft_and_cached(b, prompt()))
        finally:
            await a.close()
            await b.close()
    return out


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import load_kvfence

    threads = bench_threads()
    out = results_dir(quick)
    set_torch_threads(threads)
    loaded = load_kvfence(default_model_file())
    system_len, reps = (256, RUNS) if quick else (1024, max(5, RUNS))
    samples = asyncio.run(_measure(loaded, system_len, reps))
    ttft_ms, vs_cold, cached, targets = judge(samples)
    rows = [(k, ttft_ms[k], vs_cold[k], cached[k]) for k in samples]
    plot = bar_plot(
        out,
        f"{SUITE}_ttft",
        list(ttft_ms),
        [v.median for v in ttft_ms.values()],
        f"TTFT with a {system_len}-token system prompt",
        "median TTFT ms",
    )
    md = "\n\n".join(
        [
            f"# Prefix cache{' (quick)' if quick else ''}",
            f"System prompt {system_len} tokens + {SUFFIX}-token suffix; {reps} repetitions, caches "
            f"purged before each; max_tokens 2; {threads} threads. Median [min–max] of the "
            f"repetitions; / cold is paired by repetition; targets use the worst repetition.",
            md_table(("request", "TTFT ms", "/ cold", "max cached tokens"), rows),
            targets_table(targets),
            f"![ttft]({plot})",
        ]
    )
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "system_prompt_tokens": system_len,
        "samples": samples,
        "ttft_ms": ttft_ms,
        "ttft_over_cold": vs_cold,
        "cached_tokens": cached,
        "targets": targets,
    }
    write_suite(out, SUITE, data, md)
    return data


def judge(
    samples: dict[str, list[tuple[float, int]]],
) -> tuple[dict[str, Spread], dict[str, Spread], dict[str, int], list[Target]]:
    """TTFT ms and TTFT / cold (paired by repetition) per request kind, the most cached tokens
    each kind was reported, and the targets, each judged on its worst repetition."""
    cold = [t for t, _ in samples["cold"]]
    ttft_ms = {k: spread(1000 * t for t, _ in v) for k, v in samples.items()}
    vs_cold = {
        k: spread(t / c for (t, _), c in zip(v, cold, strict=True)) for k, v in samples.items()
    }
    cached = {k: max(c for _, c in v) for k, v in samples.items()}
    targets = [
        worst_target(
            "warm / cold TTFT (same tenant)", vs_cold["warm"], 0.2, higher_is_better=False
        ),
        Target(
            "cached tokens for the other tenant (most in any repetition)",
            float(cached["other tenant"]),
            0.0,
            higher_is_better=False,
        ),
    ]
    return ttft_ms, vs_cold, cached, targets
