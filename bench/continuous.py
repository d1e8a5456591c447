"""Suite 3, continuous vs static batching, both on kvfence's own model forward and KV cache.

64 prompts x 128 random tokens; output lengths ~ Exponential(mean 64), capped at 256 (>= 1).
Both run at most MAX_BATCH sequences at a time. Continuous = the kvfence engine (a finished
sequence's slot is refilled at the next step). Static = fixed batches in request order, each
run to its longest member: a bare greedy loop over `DecoderModel.forward` with the paged KV
cache, where finished rows keep decoding until the batch ends (as padded static batching does),
and a request completes when its batch does. The two modes are timed RUNS times, interleaved;
every figure is the median [min–max] of the runs, and the speedup is paired run by run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from bench.common import (
    FIRST_PLAIN_TOKEN,
    RUNS,
    Spread,
    Work,
    bar_plot,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    percentile,
    results_dir,
    set_torch_threads,
    spread,
    spreads,
    write_suite,
)

SUITE = "continuous"
MAX_BATCH = 16
TENANT = "bench"


def workload(quick: bool, vocab: int) -> list[Work]:
    n, plen, mean, cap = (8, 16, 8, 16) if quick else (64, 128, 64, 256)
    rng = np.random.default_rng(0)
    outs = np.clip(np.rint(rng.exponential(mean, size=n)), 1, cap).astype(int)
    return [
        Work(tuple(int(i) for i in rng.integers(FIRST_PLAIN_TOKEN, vocab, size=plen)), int(o))
        for o in outs
    ]


def _grow(cache: Any, seq_id: str, num_tokens: int) -> None:
    fit = cache.allocate_slots(seq_id, num_tokens)
    if not fit.ok:
        raise RuntimeError(f"static batch does not fit the KV pool ({fit.reason})")


def _attn(cache: Any, entries: Sequence[Any]) -> Any:
    plan = cache.begin_step(entries)
    if plan.refused:
        raise RuntimeError(f"fence refused {plan.refused[0][1]}")
    return plan.attn


def static_batch(loaded: Any, cache: Any, batch: Sequence[Work], tag: str) -> int:
    """Greedy-run one static batch to its longest member; returns decode positions computed."""
    from kvcache import StepEntry

    model = loaded.model
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    for sid, w in zip(ids, batch, strict=True):
        cache.open(sid, TENANT, w.prompt_ids, use_prefix_cache=False)
        _grow(cache, sid, len(w.prompt_ids))
    seqs = [list(w.prompt_ids) for w in batch]  # each sequence's tokens (the caller owns them)
    lens = [len(w.prompt_ids) for w in batch]
    entries = [StepEntry(sid, 0, n) for sid, n in zip(ids, lens, strict=True)]
    input_ids = torch.tensor([t for w in batch for t in w.prompt_ids], dtype=torch.long)
    positions = torch.cat([torch.arange(n) for n in lens])
    last_rows = torch.tensor(np.cumsum(lens) - 1, dtype=torch.long)
    computed = list(lens)
    positions_run = 0
    with torch.inference_mode():
        logits = model(input_ids, positions, _attn(cache, entries), last_rows)
        for _ in range(max(w.max_tokens for w in batch) - 1):
            tokens = logits.argmax(dim=-1)
            for sid, seq, n, tok in zip(ids, seqs, computed, tokens.tolist(), strict=True):
                cache.commit(sid, seq, n)
                seq.append(tok)
                _grow(cache, sid, n + 1)
            entries = [StepEntry(sid, n, 1) for sid, n in zip(ids, computed, strict=True)]
            positions = torch.tensor(computed, dtype=torch.long)
            logits = model(tokens, positions, _attn(cache, entries), None)
            computed = [n + 1 for n in computed]
            positions_run += len(batch)
    for sid in ids:
        cache.free(sid)
    return positions_run + len(batch)


def run_static(loaded: Any, work: Sequence[Work], kv_bytes: int) -> dict[str, Any]:
    from kvcache import CacheConfig
    from service.engine.factory import build_cache

    cache = build_cache(loaded.model, CacheConfig(default_ttl_s=0.0), kv_bytes=kv_bytes)
    static_batch(loaded, cache, work[:2], "warm")
    start = time.perf_counter()
    done: list[float] = []
    positions = 0
    for i in range(0, len(work), MAX_BATCH):
        batch = work[i : i + MAX_BATCH]
        positions += static_batch(loaded, cache, batch, f"b{i}")
        done += [time.perf_counter() - start] * len(batch)
    return _row("static", work, time.perf_counter() - start, done, positions)


def run_continuous(loaded: Any, work: Sequence[Work], sizing: Any) -> dict[str, Any]:
    from bench.kvfence_runner import check_complete, run_engine, started_engine

    with started_engine(loaded, sizing) as engine:
        asyncio.run(run_engine(engine, work[:2], (TENANT,), bypass_prefix_cache=True))
        start = time.perf_counter()
        wall, traces = asyncio.run(run_engine(engine, work, (TENANT,), bypass_prefix_cache=True))
    check_complete(work, traces)
    done = [t.end - start for t in traces]
    return _row("continuous (engine)", work, wall, done, sum(w.max_tokens for w in work))


def _row(
    name: str, work: Sequence[Work], wall: float, done: list[float], positions: int
) -> dict[str, Any]:
    out = sum(w.max_tokens for w in work)
    return {
        "mode": name,
        "wall_s": wall,
        "output_tokens": out,
        "output_tok_s": out / wall,
        "decode_positions": positions,
        "latency_mean_s": float(np.mean(done)),
        "latency_p50_s": percentile(done, 50),
        "latency_p99_s": percentile(done, 99),
    }


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import Sizing, load_kvfence

    threads = bench_threads()
    out = results_dir(quick)
    set_torch_threads(threads)
    loaded = load_kvfence(default_model_file())
    work = workload(quick, loaded.model.config.vocab_size)
    sizing = Sizing(max_num_seqs=MAX_BATCH, prefix_ttl_s=0.0)
    runs: list[dict[str, Any]] = []
    for i in range(RUNS):
        for r in (run_static(loaded, work, sizing.kv_bytes), run_continuous(loaded, work, sizing)):
            print(f"[{SUITE}] run {i}: {r['mode']}: {r['output_tok_s']:.1f} output tok/s", flush=True)
            runs.append(r)
    rows, speedup = aggregate(runs)
    table = md_table(
        ("mode", "output tok/s", "wall s", "decode positions", "mean latency s", "p99 latency s"),
        [
            (
                r["mode"],
                r["output_tok_s"],
                r["wall_s"],
                r["decode_positions"],
                r["latency_mean_s"],
                r["latency_p99_s"],
            )
            for r in rows
        ],
    )
    plot = bar_plot(
        out,
        f"{SUITE}_throughput",
        [r["mode"] for r in rows],
        [r["output_tok_s"].median for r in rows],
        "Continuous vs static batching",
        "output tok/s",
    )
    md = "\n\n".join(
        [
            f"# Continuous vs static batching{' (quick)' if quick else ''}",
            f"{len(work)} requests, prompts {len(work[0].prompt_ids)} tokens, outputs "
            f"Exponential(mean {8 if quick else 64}) capped at {16 if quick else 256} "
            f"(total {sum(w.max_tokens for w in work)}); max batch {MAX_BATCH}; {threads} threads. "
            f"Median [min–max] of {RUNS} interleaved runs per mode.",
            table,
            f"Continuous / static output throughput (paired by run): **{speedup}x**",
            f"![throughput]({plot})",
        ]
    )
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "max_batch": MAX_BATCH,
        "rows": rows,
        "runs": runs,
        "speedup": speedup,
        "targets": [],
    }
    write_suite(out, SUITE, data, md)
    return data


FIGURES = ("output_tok_s", "wall_s", "latency_mean_s", "latency_p50_s", "latency_p99_s")


def aggregate(runs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], Spread]:
    """One row per mode (figures as Spreads over its runs, in first-seen order) and the
    continuous / static speedup of each run pair (the i-th run of each mode)."""
    modes: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        modes.setdefault(r["mode"], []).append(r)
    rows = [
        {"mode": mode, "decode_positions": group[0]["decode_positions"], **spreads(group, FIGURES)}
        for mode, group in modes.items()
    ]
    static, cont = modes["static"], modes["continuous (engine)"]
    speedup = spread(
        c["output_tok_s"] / s["output_tok_s"] for s, c in zip(static, cont, strict=True)
    )
    return rows, speedup
