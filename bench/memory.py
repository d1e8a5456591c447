"""Suite: resident memory for each ``--weights`` mode, and what each buys at one stream.

Each mode (``auto``, ``bf16``, ``int8``, ``int4``) runs in a fresh interpreter of its own (a
process's RSS only grows, so modes measured in one process would hide each other): load the
default GGUF, then start the engine with the benchmark's default KV pool and decode one
request (32-token prompt, 128 tokens, greedy, ignore_eos) after a warm-up. Reported per mode:
RSS after the load, peak RSS (VmHWM) at the end, the packed integer copies' size, and decode
tok/s of that request. Every figure is the median [min–max] of RUNS fresh processes.

What it shows: the packed int4/int8 copies sit beside the dense bf16 weights (prefill and
batches above a few rows run the dense ones through oneDNN), so ``auto`` costs the packed
size on top of ``bf16`` and buys the single-stream decode rate; the pool is the same in every
mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import (
    RUNS,
    Spread,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    results_dir,
    set_torch_threads,
    spread,
    write_suite,
)

SUITE = "memory"
MODES = ("auto", "bf16", "int8", "int4")
PROMPT, OUTPUT = 32, 128
FIGURES = ("rss_after_load_mb", "peak_rss_mb", "packed_mb", "decode_tok_s")


def _status_mb(field: str) -> float:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def measure(mode: str, quick: bool) -> dict[str, float]:
    """One mode in this (fresh) process."""
    from bench.common import random_work
    from bench.kvfence_runner import check_complete, run_engine, started_engine
    from service.model.loader import load_model

    set_torch_threads(bench_threads())
    loaded = load_model(str(default_model_file()), weights=mode, progress=False)
    after_load = _status_mb("VmRSS")
    vocab = loaded.model.config.vocab_size
    output = 8 if quick else OUTPUT
    work = random_work(0, 1, (PROMPT, PROMPT), (output, output), vocab)
    warm = random_work(1, 1, (PROMPT, PROMPT), (8, 8), vocab)
    with started_engine(loaded) as engine:
        asyncio.run(run_engine(engine, warm, ("t",)))
        _, traces = asyncio.run(run_engine(engine, work, ("t",)))
    check_complete(work, traces)
    chunks = traces[0].chunk_times
    packed = loaded.model.packed
    return {
        "rss_after_load_mb": after_load,
        "peak_rss_mb": _status_mb("VmHWM"),
        "packed_mb": (packed.nbytes if packed is not None else 0) / 2**20,
        # tokens after the first over the time between the first and the last chunk
        "decode_tok_s": (traces[0].output_tokens - 1) / max(chunks[-1] - chunks[0], 1e-9),
    }


def _child(mode: str, quick: bool) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.memory", "--mode", mode, *(["--quick"] if quick else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode}: the measuring process exited with {done.returncode}: "
                           f"{done.stderr.strip().splitlines()[-1:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def aggregate(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Spread]]:
    return {mode: {k: spread(r[k] for r in rs) for k in FIGURES} for mode, rs in runs.items()}


def run(quick: bool = False) -> dict[str, Any]:
    out = results_dir(quick)
    threads = bench_threads()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(RUNS):
        for mode in MODES:
            runs[mode].append(_child(mode, quick))
            row = runs[mode][-1]
            print(f"[{SUITE}] run {r}: {mode}: load RSS {row['rss_after_load_mb']:.0f} MB, peak "
                  f"{row['peak_rss_mb']:.0f} MB, {row['decode_tok_s']:.1f} tok/s", flush=True)
    figures = aggregate(runs)
    rows = [
        (m, f["rss_after_load_mb"], f["peak_rss_mb"], f["packed_mb"], f["decode_tok_s"])
        for m, f in figures.items()
    ]
    md = "\n\n".join([
        f"# Memory per weights mode{' (quick)' if quick else ''}",
        f"Each mode in a fresh process: load the default GGUF, start the engine (default KV "
        f"pool), one request of {PROMPT} prompt tokens and {OUTPUT} output tokens after a "
        f"warm-up. Median [min–max] of {RUNS} processes per mode; {threads} threads.",
        md_table(("--weights", "RSS after load MB", "peak RSS MB", "packed copies MB",
                  "decode tok/s (1 stream)"), rows),
    ])
    data = {"suite": SUITE, "quick": quick, "machine": machine_info(threads), "runs": runs,
            "figures": figures, "targets": []}
    write_suite(out, SUITE, data, md)
    return data


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(measure(args.mode, args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
