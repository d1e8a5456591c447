"""One load run against a front, in a process of its own: ``python -m bench.front_load SPEC OUT``.

The online_http suite compares the server's two fronts, so neither client may share the
server's interpreter: in process, the ``openai`` SDK's per-chunk parsing (httpx's h11 framing,
pydantic models) took interpreter time from the server that gRPC's C-parsed client did not,
and was charged to the HTTP front. ``SPEC`` (JSON) names the front (``grpc`` or ``http``),
its address, the tenants and their keys, the work (prompt ids, max tokens), and the load
(``max_concurrency`` or ``arrivals``, ``response_format``, ``model``, ``extra_body``). One untimed request
first (the process's connections and imports are not the front's cost), then the timed run;
``OUT`` gets ``{"wall": seconds, "traces": [RequestTrace fields]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import Work
from bench.traces import RequestTrace

WARM = Work((1, 2, 3), 1)


def spec(
    front: str,
    address: str,
    keys: Mapping[str, str],
    work: Sequence[Work],
    tenants: Sequence[str],
    **load: Any,
) -> dict[str, Any]:
    return {"front": front, "address": address, "keys": dict(keys), "tenants": list(tenants),
            "work": [[list(w.prompt_ids), w.max_tokens] for w in work], **load}


async def _run(s: Mapping[str, Any]) -> tuple[float, list[RequestTrace]]:
    from bench.http_client import run_http
    from bench.kvfence_runner import run_grpc

    work = [Work(tuple(ids), n) for ids, n in s["work"]]
    tenants = s["tenants"]
    load: dict[str, Any] = {"arrivals": s.get("arrivals"), "max_concurrency": s.get("max_concurrency")}
    if s["front"] == "grpc":
        await run_grpc(s["address"], s["keys"], [WARM], tenants[:1])
        return await run_grpc(s["address"], s["keys"], work, tenants, **load)
    http: dict[str, Any] = {"model": s["model"], "response_format": s.get("response_format"),
                            "extra_body": s.get("extra_body")}
    await run_http(s["address"], s["keys"], [WARM], tenants[:1], **http)
    return await run_http(s["address"], s["keys"], work, tenants, **load, **http)


async def in_own_process(
    s: Mapping[str, Any], scratch: Path, cpus: set[int] | None = None
) -> tuple[float, list[RequestTrace]]:
    """Run ``s`` in a child process while this process's loop (the server) keeps serving;
    ``cpus``: the cores the child may use (set before it imports anything)."""
    spec_file, out_file = scratch / "spec.json", scratch / "out.json"
    spec_file.write_text(json.dumps(s))
    out_file.unlink(missing_ok=True)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.front_load", str(spec_file), str(out_file),
        stderr=asyncio.subprocess.PIPE,
    )
    if cpus is not None:
        os.sched_setaffinity(child.pid, cpus)
    _, err = await child.communicate()
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"{s['front']} load process exited with {child.returncode}: {tail}")
    done = json.loads(out_file.read_text())
    return float(done["wall"]), [RequestTrace(**t) for t in done["traces"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    wall, traces = asyncio.run(_run(json.loads(args.spec.read_text())))
    args.out.write_text(json.dumps({"wall": wall, "traces": [dataclasses.asdict(t) for t in traces]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
