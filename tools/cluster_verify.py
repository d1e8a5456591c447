"""``make cluster-verify``: the six scale-out checks against the loopback cluster.

Uses the cluster ``make cluster`` started when it is up, else starts one and stops it at the
end. Prints one table, writes ``docs/cluster.json``, exits 1 if any row fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from tools.cluster.__main__ import WORKDIR
from tools.cluster.checks import Row
from tools.cluster.faults import FaultChecks
from tools.cluster.local import ClusterSettings, ClusterState, LocalCluster, missing_tools

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "cluster.json"


async def run_checks(cluster: LocalCluster, only: set[str]) -> list[Row]:
    checks = FaultChecks(cluster)
    steps = [
        ("1 affinity", checks.affinity),
        ("2 isolation", checks.isolation),
        ("3 global limits", checks.global_limits),
        ("4 replica loss", checks.replica_loss),
        ("5 drain", checks.drain),
        ("6 redis down", checks.redis_down),
    ]
    rows: list[Row] = []
    try:
        for name, step in steps:
            if only and name.split()[0] not in only:
                continue
            began = time.monotonic()
            print(f"cluster-verify: {name} ...", flush=True)
            try:
                row = await step()
            except Exception as err:  # a check that cannot run is a failed row, not a crash
                traceback.print_exc()
                row = Row(name, False, f"could not run: {type(err).__name__}: {err}")
            row.figures["seconds"] = round(time.monotonic() - began, 1)
            rows.append(row)
    finally:
        await checks.close()
    return rows


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  result  figures", f"{'-' * width}  ------  -------"]
    lines += [f"{r.check:<{width}}  {'PASS' if r.passed else 'FAIL':<6}  {r.summary}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cluster_verify")
    parser.add_argument("--only", nargs="*", default=[], help="check numbers to run (default all)")
    args = parser.parse_args(argv)
    # SIGTERM (CI timeouts, kill) stops the cluster this run started, like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if missing := missing_tools():
        print(f"cluster-verify: needs {' '.join(missing)}: apt-get install {' '.join(missing)}")
        return 1
    state = ClusterState.load(WORKDIR)
    owned = state is None or not LocalCluster(state).is_up()
    if state is not None and owned:
        LocalCluster(state).down()
    cluster = LocalCluster.create(WORKDIR, ClusterSettings()) if owned else LocalCluster(state)  # type: ignore[arg-type]
    started = time.monotonic()
    try:
        if owned:
            print("cluster-verify: starting 3 replicas, HAProxy and Redis ...", flush=True)
            cluster.up()
        print(f"cluster-verify: cluster up at {cluster.state.lb} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
        rows = asyncio.run(run_checks(cluster, set(args.only)))
    finally:
        if owned:
            cluster.down()
    for row in rows:
        if not row.passed:
            print(f"cluster-verify: {row.check} failed; figures: {json.dumps(row.figures)}")
    print(table(rows))
    if args.only:
        return 0 if all(r.passed for r in rows) else 1
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "settings": cluster.state.settings,
        "seconds": round(time.monotonic() - started, 1),
        "passed": all(r.passed for r in rows),
        "rows": [asdict(r) for r in rows],
    }, indent=2) + "\n")
    print(f"cluster-verify: wrote {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
