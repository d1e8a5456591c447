"""The gRPC load generator as its own process, as GuideLLM is on the HTTP side, so neither
client shares the server's interpreter (and GIL) in a front-to-front comparison.

``python -m bench.grpc_load TARGET API_KEY PROMPTS.jsonl OUT.json [--concurrency N]
[--rate R --seed S]`` sends each line's ``prompt`` with ``max_tokens`` =
``output_tokens_count`` (ignore_eos) and writes ``bench.traces.summarize``'s dict. Sampling is
at temperature 1 unless ``--temperature`` says otherwise: GuideLLM sends no temperature, so the
OpenAI default (1) applies to its requests, and sampling costs the engine more than greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import Work
from bench.kvfence_runner import check_complete, run_grpc
from bench.online import poisson_arrivals
from bench.online_guidellm import sent_rate
from bench.traces import RequestTrace, summarize

TENANT = "load"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target")
    parser.add_argument("api_key")
    parser.add_argument("prompts", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals (req/s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.prompts.read_text(encoding="utf-8").splitlines()]
    texts = [r["prompt"] for r in rows]
    # prompt_ids only size the trace; the server tokenizes the text.
    work = [Work((), int(r["output_tokens_count"])) for r in rows]
    arrivals = poisson_arrivals(args.rate, len(work), args.seed) if args.rate else None
    keys = {TENANT: args.api_key}

    async def timed() -> tuple[float, list[RequestTrace]]:
        # One untimed request first: gRPC's one-off process set-up (its core, threads, the first
        # connection) is not the front's cost; GuideLLM's clock starts after its connect too.
        await run_grpc(args.target, keys, [Work((), 1)], (TENANT,), texts=["warm-up"])
        return await run_grpc(args.target, keys, work, (TENANT,), arrivals=arrivals,
                              max_concurrency=args.concurrency, texts=texts,
                              temperature=args.temperature)

    wall, traces = asyncio.run(timed())
    check_complete(work, traces)
    summary = summarize(traces, wall)
    del summary["total_tok_s"]  # the traces hold no prompt token counts
    summary["sent_req_s"] = sent_rate([t.start for t in traces])
    to_unix = time.time() - time.perf_counter()
    summary["window_unix"] = [min(t.start for t in traces) + to_unix,
                              max(t.end for t in traces) + to_unix]
    args.out.write_text(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
