"""Run every benchmark suite one after another: `python -m bench.run_all [--quick] [--only S]`.

Full-run sizing targets about 25 minutes on 2 cores for every suite but ``tiers``, which
takes about an hour more on a 2-core EPYC with two tiers (it sweeps one llama-server per tier
and model; measured 2,495 s with one offline run per case and run, and each case and run
sends the offline work three times, for the isolation tax: ~20 minutes more). See docs/benchmarks.md for what each suite runs. Systems never
run concurrently; each suite reports its own targets.
Each suite runs in its own interpreter: a suite that ran torch on the main thread leaves an
OpenMP pool there, which slows every engine thread started after it (service.model.threads;
measured: offline untimed engine 130 output tok/s after the overhead suite in the same
process, 184 alone).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from bench import (
    continuous,
    isolation_cost,
    lora,
    memory,
    offline,
    online,
    online_guidellm,
    online_http,
    overhead,
    prefix,
    shared_prefix,
    single_stream,
    tiers,
)
from bench.common import results_dir
from bench.summary import SUITE_ORDER, write_summary

SUITES: dict[str, Callable[[bool], dict[str, Any]]] = {
    "single_stream": single_stream.run,
    "offline": offline.run,
    "overhead": overhead.run,
    "memory": memory.run,
    "continuous": continuous.run,
    "online": online.run,
    "online_http": online_http.run,
    "online_guidellm": online_guidellm.run,
    "prefix": prefix.run,
    "shared_prefix": shared_prefix.run,
    "isolation_cost": isolation_cost.run,
    "lora": lora.run,
    "tiers": tiers.run,
}
assert tuple(SUITES) == SUITE_ORDER


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke-sized run (results/quick/)"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=list(SUITES),
        metavar="SUITE",
        help=f"run only this suite (repeatable): {', '.join(SUITES)}",
    )
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    chosen = args.only or list(SUITES)
    failures: dict[str, str] = {}
    started = time.perf_counter()
    for name in chosen:
        t0 = time.perf_counter()
        print(f"== {name} ==", flush=True)
        if args.here:
            try:
                SUITES[name](args.quick)
            except Exception as err:  # keep going: one failed suite must not hide the others
                failures[name] = f"{type(err).__name__}: {err}"
                traceback.print_exc()
        else:
            child = [sys.executable, "-m", "bench.run_all", "--here", "--only", name]
            code = subprocess.run([*child, *(["--quick"] if args.quick else [])]).returncode
            if code != 0:
                failures[name] = f"the suite's process exited with {code}"
        print(f"== {name}: {time.perf_counter() - t0:.0f}s ==", flush=True)
    if args.here:  # the parent writes the summary once every suite is done
        return 1 if failures else 0
    out = results_dir(args.quick)
    print(write_summary(out, failures))
    print(f"total {time.perf_counter() - started:.0f}s; results in {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
