"""What batch invariance costs: ``--batch-invariant auto`` (invariant on CPU) against ``off``.

In process, the same engine settings as ``bench/offline.py``'s engine row, one engine started
per mode and round (never two at once), the two modes interleaved round by round (the
machine's load hits both alike), every request bypassing the prefix cache (rounds repeat the
same prompts):

- single stream: one request (16-token prompt, 128 greedy tokens), decode tok/s from its
  first token to its last;
- offline: ``bench/offline.py``'s 64 requests (prompts U[16,256], outputs U[16,128]).

    python -m bench.invariance_cost [--rounds 3] [--requests 64]

Prints min and median of each figure per mode, and the offline ratio invariant / variant.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from bench.common import (
    Work,
    bench_threads,
    default_model_file,
    gguf_vocab_size,
    random_work,
    set_torch_threads,
)
from bench.kvfence_runner import run_engine, started_engine
from service.engine.engine import Engine
from service.model.loader import load_model

MODES = ("auto", "off")


def single_stream(engine: Engine, vocab: int) -> float:
    work = random_work(5, 1, (16, 16), (128, 128), vocab)
    _, traces = asyncio.run(run_engine(engine, work, bypass_prefix_cache=True))
    t = traces[0]
    return (t.output_tokens - 1) / (t.end - t.chunk_times[0])


def offline(engine: Engine, work: list[Work]) -> float:
    wall, _ = asyncio.run(run_engine(engine, work, bypass_prefix_cache=True))
    return sum(w.max_tokens for w in work) / wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.invariance_cost")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64, help="offline requests")
    args = parser.parse_args(argv)
    set_torch_threads(bench_threads())
    path = default_model_file()
    vocab = gguf_vocab_size(path)
    models = {m: load_model(str(path), progress=False, batch_invariant=m) for m in MODES}
    assert models["auto"].batch_invariant and not models["off"].batch_invariant
    work = random_work(0, args.requests, (16, 256), (16, 128), vocab)
    figures: dict[str, dict[str, list[float]]] = {m: {"single": [], "offline": []} for m in MODES}
    for r in range(args.rounds):
        for m in MODES if r % 2 == 0 else MODES[::-1]:
            # one engine at a time: an idle engine's OpenMP workers spin beside the measured one
            with started_engine(models[m]) as engine:
                figures[m]["single"].append(single_stream(engine, vocab))
                figures[m]["offline"].append(offline(engine, work))
                print(f"round {r} {m}: single {figures[m]['single'][-1]:.1f} tok/s, "
                      f"offline {figures[m]['offline'][-1]:.1f} tok/s", flush=True)
    summary: dict[str, Any] = {}
    for m in MODES:
        for k, vals in figures[m].items():
            summary[f"{m} {k}"] = (min(vals), statistics.median(vals), max(vals))
            print(f"{m:>4} {k:>7}: min {min(vals):.1f} median {statistics.median(vals):.1f} "
                  f"max {max(vals):.1f} tok/s ({len(vals)} runs)")
    ratio = statistics.median(figures["auto"]["offline"]) / statistics.median(
        figures["off"]["offline"]
    )
    print(f"offline throughput, invariant / batch-variant (medians): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
