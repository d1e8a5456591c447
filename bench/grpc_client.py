"""A gRPC client in its own process, as a real client runs: ``python -m bench.grpc_client``
reads a JSON job on stdin (target, api keys, work, tenants, options), drives it with
:func:`bench.kvfence_runner.run_grpc` and writes ``{"wall_s": ..., "traces": [...]}`` on
stdout. :func:`bench.kvfence_runner.run_grpc_elsewhere` is the caller.

Why: a client in the server's own process shares its interpreter lock and event loop, so its
per-token Python (receiving, decoding the proto) is added to the server's; no deployed
client does that. The traces' clock (``time.perf_counter``, CLOCK_MONOTONIC on Linux) is the
client's own, as in-process traces are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from typing import Any

from bench.common import Work
from bench.kvfence_runner import run_grpc


async def _main(job: dict[str, Any]) -> dict[str, Any]:
    work = [Work(tuple(w["prompt_ids"]), int(w["max_tokens"])) for w in job["work"]]
    wall, traces = await run_grpc(
        job["target"],
        job["api_keys"],
        work,
        job["tenants"],
        bypass_prefix_cache=bool(job.get("bypass_prefix_cache", False)),
        max_concurrency=job.get("max_concurrency"),
    )
    return {"wall_s": wall, "traces": [dataclasses.asdict(t) for t in traces]}


def main() -> None:
    job = json.loads(sys.stdin.read())
    json.dump(asyncio.run(_main(job)), sys.stdout)


if __name__ == "__main__":
    main()
