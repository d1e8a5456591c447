"""Suite 5, prefix cache: TTFT of a repeated 1,024-token system prompt over gRPC.

Each repetition purges both tenants' caches, then sends (system prompt + a fresh 16-token
user suffix): tenant A cold, tenant A warm (its own cache hit), tenant B (the same prompt,
which must stay cold: caches are per tenant). TTFT is measured at the client.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np

from bench.common import (
    FIRST_PLAIN_TOKEN,
    Target,
    bar_plot,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    results_dir,
    set_torch_threads,
    targets_table,
    write_suite,
)

SUITE = "prefix"
TENANTS = ("tenant-a", "tenant-b")
SUFFIX = 16


async def _ttft(client: Any, ids: list[int]) -> tuple[float, int]:
    from clients.types import Chunk, Started

    start = time.perf_counter()
    ttft: float | None = None
    cached = -1
    async for event in client.generate(
        token_ids=ids, max_tokens=2, temperature=0.0, ignore_eos=True
    ):
        if isinstance(event, Started):
            cached = event.cached_prompt_tokens
        elif isinstance(event, Chunk) and event.token_ids and ttft is None:
            ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft, cached


async def _measure(loaded: Any, system_len: int, reps: int) -> dict[str, list[tuple[float, int]]]:
    from bench.kvfence_runner import grpc_server
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
            await _ttft(a, [int(t) for t in rng.integers(FIRST_PLAIN_TOKEN, vocab, size=64)])
            for _ in range(reps):
                await a.purge()
                await b.purge()
                out["cold"].append(await _ttft(a, prompt()))
                out["warm"].append(await _ttft(a, prompt()))
                out["other tenant"].append(await _ttft(b, prompt()))
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
    system_len, reps = (256, 2) if quick else (1024, 5)
    samples = asyncio.run(_measure(loaded, system_len, reps))
    med = {k: statistics.median(t for t, _ in v) for k, v in samples.items()}
    cached = {k: max(c for _, c in v) for k, v in samples.items()}
    targets = [
        Target(
            "warm / cold TTFT (same tenant)", med["warm"] / med["cold"], 0.2, higher_is_better=False
        ),
        Target(
            "cached tokens for the other tenant",
            float(cached["other tenant"]),
            0.0,
            higher_is_better=False,
        ),
    ]
    rows = [
        (
            k,
            1000 * med[k],
            med[k] / med["cold"],
            cached[k],
            ", ".join(f"{1000 * t:.0f}" for t, _ in v),
        )
        for k, v in samples.items()
    ]
    plot = bar_plot(
        out,
        f"{SUITE}_ttft",
        list(med),
        [1000 * v for v in med.values()],
        f"TTFT with a {system_len}-token system prompt",
        "median TTFT ms",
    )
    md = "\n\n".join(
        [
            f"# Prefix cache{' (quick)' if quick else ''}",
            f"System prompt {system_len} tokens + {SUFFIX}-token suffix; {reps} repetitions, caches "
            f"purged before each; max_tokens 2; {threads} threads.",
            md_table(
                ("request", "median TTFT ms", "/ cold", "max cached tokens", "samples ms"), rows
            ),
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
        "median_ttft_s": med,
        "cached_tokens": cached,
        "targets": targets,
    }
    write_suite(out, SUITE, data, md)
    return data
