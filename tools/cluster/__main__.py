"""``python -m tools.cluster up|down|status`` (``make cluster`` runs ``up``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.cluster.local import ROOT, ClusterSettings, ClusterState, LocalCluster, missing_tools

WORKDIR = ROOT / ".cluster"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cluster")
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    args = parser.parse_args(argv)
    state = ClusterState.load(args.workdir)
    if args.action == "up":
        if state is not None and LocalCluster(state).is_up():
            print(f"kvfence cluster: already up at {state.lb} (state in {args.workdir})")
            return 0
        if state is not None:
            LocalCluster(state).down()
        if missing := missing_tools():
            print(f"kvfence cluster: needs {' '.join(missing)}: apt-get install {' '.join(missing)}")
            return 1
        cluster = LocalCluster.create(args.workdir, ClusterSettings())
        try:
            cluster.up()
        except RuntimeError as err:
            cluster.down()
            print(f"kvfence cluster: {err}", file=sys.stderr)
            return 1
        s = cluster.state
        print(f"kvfence cluster: 3 replicas behind HAProxy at {s.lb} (Redis {s.redis_url})")
        print(f"  call it:  kvfence generate --target {s.lb} --api-key {s.keys['alpha']} 'Hello'")
        print(f"  tenants and keys: {args.workdir / 'state.json'}; logs: {args.workdir / 'logs'}")
        print("  stop it:  make cluster-down")
        return 0
    if state is None:
        print("kvfence cluster: not running")
        return 0 if args.action == "down" else 1
    cluster = LocalCluster(state)
    if args.action == "down":
        cluster.down()
        print("kvfence cluster: stopped")
        return 0
    print(f"kvfence cluster at {state.lb}: {'up' if cluster.is_up() else 'partly down'}")
    for name, status in cluster.lb_states().items():
        print(f"  {name}: {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
