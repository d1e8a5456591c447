"""Suite 2, engine overhead: a full engine decode step vs the raw batched model forward.

Uses service/engine/profile.py::measure_step_overhead, which times `EngineCore.step()`
(schedule, fence, inputs, forward, sample, detokenize, stream) and the bare model forward on
the same batch of B sequences at the given context. Ratio = raw / engine (1.0 = no overhead).
"""

from __future__ import annotations

from typing import Any

from bench.common import (
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
            engine_s, raw_s = measure_step_overhead(loaded, batch, context, repeats=repeats)
            points.append(
                {
                    "batch": batch,
                    "context": context,
                    "engine_step_ms": 1000 * engine_s,
                    "raw_forward_ms": 1000 * raw_s,
                    "ratio_raw_over_engine": raw_s / engine_s,
                }
            )
            print(
                f"[{SUITE}] B={batch} ctx={context}: engine {1000 * engine_s:.2f} ms, "
                f"raw {1000 * raw_s:.2f} ms",
                flush=True,
            )
    worst = min(points, key=lambda p: p["ratio_raw_over_engine"])
    targets = [
        Target(
            f"engine step vs raw forward (worst: B={worst['batch']} ctx={worst['context']})",
            worst["ratio_raw_over_engine"],
            0.9,
        )
    ]
    rows = [
        (
            p["batch"],
            p["context"],
            p["engine_step_ms"],
            p["raw_forward_ms"],
            f"{p['ratio_raw_over_engine']:.3f}",
        )
        for p in points
    ]
    plot = bar_plot(
        out,
        f"{SUITE}_ratio",
        [f"B={p['batch']} ctx={p['context']}" for p in points],
        [100 * p["ratio_raw_over_engine"] for p in points],
        "Raw forward time as % of engine step",
        "% (100 = no overhead)",
    )
    md = "\n\n".join(
        [
            f"# Engine step overhead{' (quick)' if quick else ''}",
            f"Median of {repeats} decode steps per point; {threads} threads; dtype "
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
        "dtype": str(loaded.dtype),
        "points": points,
        "targets": targets,
    }
    write_suite(out, SUITE, data, md)
    return data
