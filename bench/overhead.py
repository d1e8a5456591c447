"""Suite 2, engine overhead: a full engine decode step vs the raw batched model forward.

Uses service/engine/profile.py::measure_step_overhead, which times `EngineCore.step()`
(schedule, fence, inputs, forward, sample, detokenize, stream) and the bare model forward on
the same batch of B sequences at the given context. Ratio = raw / engine (1.0 = no overhead).
Each point is measured in RUNS separate runs (each the median of its decode steps): the table
shows median [min–max] over the runs, and the target is judged on the worst run of any point.
"""

from __future__ import annotations

from typing import Any

from bench.common import (
    RUNS,
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

SUITE = "overhead"


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import load_kvfence
    from service.engine.profile import measure_step_overhead

    threads = bench_threads()
    out = results_dir(quick)
    set_torch_threads(threads)
    loaded = load_kvfence(default_model_file())
    batches, contexts, repeats = ((1, 4), (32,), 3) if quick else ((1, 8, 32), (128, 512), 15)
    points = []
    for context in contexts:
        for batch in batches:
            engine_ms, raw_ms = [], []
            for _ in range(RUNS):
                engine_s, raw_s = measure_step_overhead(loaded, batch, context, repeats=repeats)
                engine_ms.append(1000 * engine_s)
                raw_ms.append(1000 * raw_s)
                print(
                    f"[{SUITE}] B={batch} ctx={context}: engine {1000 * engine_s:.2f} ms, "
                    f"raw {1000 * raw_s:.2f} ms",
                    flush=True,
                )
            points.append(point(batch, context, engine_ms, raw_ms))
    worst = min(points, key=lambda p: p["ratio_raw_over_engine"].min)
    targets = [
        worst_target(
            f"engine step vs raw forward (worst: B={worst['batch']} ctx={worst['context']})",
            worst["ratio_raw_over_engine"],
            0.9,
        )
    ]
    rows = [
        (p["batch"], p["context"], p["engine_step_ms"], p["raw_forward_ms"],
         p["ratio_raw_over_engine"])
        for p in points
    ]
    plot = bar_plot(
        out,
        f"{SUITE}_ratio",
        [f"B={p['batch']} ctx={p['context']}" for p in points],
        [100 * p["ratio_raw_over_engine"].median for p in points],
        "Raw forward time as % of engine step",
        "% (100 = no overhead)",
    )
    md = "\n\n".join(
        [
            f"# Engine step overhead{' (quick)' if quick else ''}",
            f"Each point: median [min–max] of {RUNS} runs, each the median of {repeats} decode "
            f"steps; the target uses the worst run; {threads} threads; dtype "
            f"{str(loaded.dtype).removeprefix('torch.')}.",
            md_table(("B", "context", "engine step ms", "raw forward ms", "raw / engine"), rows),
            targets_table(targets),
            f"![ratio]({plot})",
        ]
    )
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "repeats": repeats,
        "runs_per_point": RUNS,
        "dtype": str(loaded.dtype),
        "points": points,
        "targets": targets,
    }
    write_suite(out, SUITE, data, md)
    return data


def point(batch: int, context: int, engine_ms: list[float], raw_ms: list[float]) -> dict[str, Any]:
    """One (B, context) point; the ratio is paired run by run (same run's engine and raw)."""
    return {
        "batch": batch,
        "context": context,
        "engine_step_ms": spread(engine_ms),
        "raw_forward_ms": spread(raw_ms),
        "ratio_raw_over_engine": spread(r / e for r, e in zip(raw_ms, engine_ms, strict=True)),
    }

