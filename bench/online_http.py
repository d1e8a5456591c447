"""Suite: online serving through the OpenAI-compatible HTTP front, beside gRPC, on the same load.

One server with both fronts on; the same random-token work (prompts of 128, outputs of 64
tokens, range ratio 0.5, greedy, ignore_eos) goes once through gRPC (``clients.AsyncClient``)
and once through HTTP with the official ``openai`` SDK (``AsyncOpenAI``, streaming
completions with token-id prompts), each with its own tenants so neither run hits the
other's prefix cache. Both run at unlimited rate with at most 32 in flight (capacity), then as
Poisson arrivals at 0.7x the gRPC capacity. Then structured outputs: the same prompts again
through HTTP, unconstrained and constrained by a regex (``[a-z ,.]*``, which never forces an
early stop), comparing output tokens/s.

NOTE: the load generator is the ``openai`` SDK, not GuideLLM: guidellm 0.8 pulls datasets,
pyarrow, sanic and uvloop into the bench environment and needs a Hugging Face processor
directory for its synthetic token-count data, which the embedded GGUF model does not ship.
The SDK path sends exactly what GuideLLM's OpenAI backend sends (streaming
``/v1/completions``), and the traces feed the same summary as the gRPC suite.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from bench.common import (
    Target,
    Work,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    random_work,
    results_dir,
    set_torch_threads,
    targets_table,
    write_suite,
)
from bench.kvfence_runner import STREAM_QUOTA, Sizing, check_complete, drive, run_grpc
from bench.online import MAX_CONCURRENCY, poisson_arrivals
from bench.traces import RequestTrace, summarize

SUITE = "online_http"
GRPC_TENANTS = ("grpc-a", "grpc-b", "grpc-c")
HTTP_TENANTS = ("http-a", "http-b", "http-c")
FREE_TENANTS = ("free-a", "free-b")
CONSTRAINED_TENANTS = ("json-a", "json-b")
REGEX = "[a-z ,.]*"
POISSON_FRACTION = 0.7
FULL = (100, 128, 64)  # requests, mean prompt tokens, mean output tokens
QUICK = (12, 32, 8)


@asynccontextmanager
async def both_fronts(
    loaded: Any, tenants: Sequence[str], sizing: Sizing | None = None
) -> AsyncIterator[tuple[str, str, dict[str, str]]]:
    """One in-process server with gRPC and HTTP on; yields (gRPC target, HTTP base URL, keys)."""
    from service.app import build_server
    from service.grpc_server import ServerOptions
    from service.logging import make_logger
    from service.tenants import Quotas, Tenant, TenantRegistry, hash_key, new_api_key

    keys = {t: new_api_key() for t in tenants}
    registry = TenantRegistry({
        t: Tenant(t, key_hashes=(hash_key(k),), quotas=Quotas(max_concurrent_streams=STREAM_QUOTA))
        for t, k in keys.items()
    })
    log = make_logger("json", io.StringIO())
    stack = await asyncio.to_thread(
        build_server, loaded, (sizing or Sizing()).serve_sizing(), registry, ServerOptions(http_port=0), log
    )
    try:
        port = await stack.server.start()
        assert stack.server.http is not None
        if stack.grammars is not None:
            await asyncio.to_thread(stack.grammars.warm)
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{stack.server.http.port}/v1", keys
    finally:
        await stack.server.close()
        await asyncio.to_thread(stack.engine.shutdown)


async def run_http(
    base_url: str,
    api_keys: Mapping[str, str],
    work: Sequence[Work],
    tenants: Sequence[str],
    *,
    model: str,
    arrivals: Sequence[float] | None = None,
    max_concurrency: int | None = None,
    regex: str | None = None,
) -> tuple[float, list[RequestTrace]]:
    """``run_grpc``'s twin over HTTP: streaming ``/v1/completions`` through ``AsyncOpenAI``."""
    import openai

    clients = {t: openai.AsyncOpenAI(base_url=base_url, api_key=api_keys[t], max_retries=0,
                                     timeout=600) for t in tenants}
    extra: dict[str, Any] = {"ignore_eos": True}
    if regex is not None:
        extra["response_format"] = {"type": "regex", "regex": regex}

    async def one(i: int) -> RequestTrace:
        w = work[i]
        trace = RequestTrace(tenants[i % len(tenants)], len(w.prompt_ids), time.perf_counter())
        stream = await clients[trace.tenant].completions.create(
            model=model, prompt=list(w.prompt_ids), max_tokens=w.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.finish_reason is not None:
                    trace.end = now
                    trace.finish_reason = choice.finish_reason
                else:
                    trace.on_chunk(now, 1)  # one chunk per generated token
            elif chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                trace.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens or 0
        return trace

    try:
        return await drive(len(work), one, arrivals, max_concurrency)
    finally:
        for client in clients.values():
            await client.close()


def _entry(front: str, label: str, rate: float | None, wall: float,
           traces: list[RequestTrace]) -> dict[str, Any]:
    overall = summarize(traces, wall)
    print(f"[{SUITE}] {front} rate={label}: {overall['req_s']:.2f} req/s, "
          f"{overall['output_tok_s']:.1f} out tok/s, TTFT p50 {overall['ttft_p50_ms']:.0f} ms",
          flush=True)
    return {"front": front, "rate": label, "request_rate": rate, "overall": overall}


async def _runs(loaded: Any, quick: bool) -> list[dict[str, Any]]:
    n, inp, out = QUICK if quick else FULL
    vocab = loaded.model.config.vocab_size
    work = random_work(0, n, (inp // 2, inp * 3 // 2), (out // 2, out * 3 // 2), vocab)
    warm = random_work(1, 6, (inp // 2, inp), (2, 4), vocab)
    tenants = GRPC_TENANTS + HTTP_TENANTS + FREE_TENANTS + CONSTRAINED_TENANTS
    model = loaded.name
    runs: list[dict[str, Any]] = []
    async with both_fronts(loaded, tenants) as (target, base_url, keys):
        await run_grpc(target, keys, warm, GRPC_TENANTS)
        await run_http(base_url, keys, warm, HTTP_TENANTS, model=model)
        await run_http(base_url, keys, warm, CONSTRAINED_TENANTS, model=model, regex=REGEX)
        wall, traces = await run_grpc(target, keys, work, GRPC_TENANTS,
                                      max_concurrency=MAX_CONCURRENCY)
        check_complete(work, traces)
        runs.append(_entry("gRPC", "inf", None, wall, traces))
        wall, traces = await run_http(base_url, keys, work, HTTP_TENANTS, model=model,
                                      max_concurrency=MAX_CONCURRENCY)
        check_complete(work, traces)
        runs.append(_entry("HTTP", "inf", None, wall, traces))
        rate = POISSON_FRACTION * runs[0]["overall"]["req_s"]
        arrivals = poisson_arrivals(rate, n, seed=1)
        wall, traces = await run_grpc(target, keys, work, GRPC_TENANTS, arrivals=arrivals)
        runs.append(_entry("gRPC", f"{rate:.2f}", rate, wall, traces))
        wall, traces = await run_http(base_url, keys, work, HTTP_TENANTS, model=model,
                                      arrivals=arrivals)
        runs.append(_entry("HTTP", f"{rate:.2f}", rate, wall, traces))
        wall, traces = await run_http(base_url, keys, work, FREE_TENANTS, model=model,
                                      max_concurrency=MAX_CONCURRENCY)
        runs.append(_entry("HTTP unconstrained", "inf", None, wall, traces))
        wall, traces = await run_http(base_url, keys, work, CONSTRAINED_TENANTS, model=model,
                                      max_concurrency=MAX_CONCURRENCY, regex=REGEX)
        runs.append(_entry(f"HTTP regex {REGEX}", "inf", None, wall, traces))
    return runs


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import load_kvfence

    threads = bench_threads()
    out = results_dir(quick)
    set_torch_threads(threads)
    loaded = load_kvfence(default_model_file())
    runs = asyncio.run(_runs(loaded, quick))
    grpc_inf, http_inf, _, _, free, constrained = runs
    targets = [
        Target("HTTP / gRPC output tok/s (same load, capacity)",
               http_inf["overall"]["output_tok_s"] / grpc_inf["overall"]["output_tok_s"], 0.95),
        Target("regex-constrained / unconstrained output tok/s (HTTP)",
               constrained["overall"]["output_tok_s"] / free["overall"]["output_tok_s"], 0.90),
    ]
    cols = ("front", "rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
            "ITL p50", "ITL p99")
    rows = [(r["front"], r["rate"], r["overall"]["req_s"], r["overall"]["output_tok_s"],
             r["overall"]["ttft_p50_ms"], r["overall"]["ttft_p99_ms"], r["overall"]["tpot_p50_ms"],
             r["overall"]["itl_p50_ms"], r["overall"]["itl_p99_ms"]) for r in runs]
    md = "\n\n".join([
        f"# Online serving: HTTP (OpenAI API) vs gRPC{' (quick)' if quick else ''}",
        f"{runs[0]['overall']['requests']} requests per run; rate `inf` = at most "
        f"{MAX_CONCURRENCY} in flight; the other rate is Poisson at {POISSON_FRACTION} x the "
        f"gRPC capacity. HTTP is driven by the `openai` SDK. Times in ms; {threads} threads.",
        targets_table(targets), md_table(cols, rows),
    ])
    data = {"suite": SUITE, "quick": quick, "machine": machine_info(threads), "runs": runs,
            "targets": [t.as_dict() for t in targets]}
    write_suite(out, SUITE, data, md)
    return data
