"""Microbenchmark: the B=1 decode step and process RSS for one ``--weights`` mode.

``python -m bench.decode_step --weights auto [--threads N] [--repeats R] [--context C]``
loads the default model, times ``EngineCore.step()`` and the raw forward at batch 1
(service/engine/profile.py, medians of R alternating steps) and prints one JSON line with
both in ms and the resident set (VmRSS, VmHWM) in MiB. Run it once per mode, each in its own
process, so RSS counts only that mode's weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rss_mib() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--weights", default="auto", choices=["auto", "bf16", "int4", "int8"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    import torch

    from bench.common import bench_threads, default_model_file
    from service.engine.profile import measure_step_overhead
    from service.model import load_model

    threads = args.threads or bench_threads()
    torch.set_num_threads(threads)
    loaded = load_model(default_model_file(), weights=args.weights, progress=False)
    engine_s, raw_s = measure_step_overhead(loaded, 1, args.context, repeats=args.repeats)
    print(
        json.dumps(
            {
                "weights": args.weights,
                "resolved": loaded.weights,
                "threads": threads,
                "context": args.context,
                "engine_step_ms": round(1000 * engine_s, 2),
                "raw_forward_ms": round(1000 * raw_s, 2),
                **{k: round(v, 1) for k, v in rss_mib().items()},
            }
        )
    )


if __name__ == "__main__":
    main()
