"""Suite: online serving through the OpenAI-compatible HTTP front, beside gRPC, on the same load.

One server with both fronts on; the same random-token work (prompts of 128, outputs of 64
tokens, range ratio 0.5, greedy, ignore_eos) goes through gRPC (``clients.AsyncClient``) and
through HTTP with the official ``openai`` SDK (``AsyncOpenAI``, streaming completions with
token-id prompts), then through HTTP again unconstrained and constrained by a JSON schema whose
one string cannot close within max_tokens (so every token is masked and no run stops early).
These four capacity runs (at most 32 in flight) repeat in 3 interleaved rounds, each run with
tenants of its own so none hits another's prefix cache; the two ratios (HTTP / gRPC and
constrained / unconstrained output tok/s) are taken per round, shown as median [min–max] and
judged on the worst round (after one untimed round of all four, so no front's first run in a
fresh server is timed). Then 3 rounds of one Poisson run per front at 0.7x the median gRPC
capacity.

Every timed run's client runs in a process of its own (``bench.front_load``), pinned to the
cores the server does not use (``split_cores``): inside the server's process the SDK's
per-chunk parsing took interpreter time from the server that the gRPC client's did not
(measured on a 2-core machine with AMX: HTTP 0.82x gRPC in process), and on shared cores the
heavier client still took CPU from the server (worst round 0.937 with clients out of process
but unpinned). A deployed server does not share its cores with its clients.
bench/online_guidellm.py drives the HTTP front with GuideLLM instead, on the same texts.

The peer is ``llama-server`` (bench/llama_server.py) on the server's cores, driven by the same
client process and work: its slot count (then physical batch) is swept by one capacity run
each on the first quarter of the work before kvfence's server starts, and the fastest server
then stays up, idle while kvfence runs, so that its capacity and Poisson runs take their place
in the same interleaved rounds (the Poisson runs at the same arrivals as kvfence's fronts).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import statistics
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from bench import front_load, llama_server
from bench.common import (
    Work,
    bench_threads,
    default_model_file,
    machine_info,
    md_table,
    pin_process,
    random_work,
    results_dir,
    set_torch_threads,
    split_cores,
    spread,
    targets_table,
    worst_target,
    write_suite,
)
from bench.http_client import run_http
from bench.kvfence_runner import STREAM_QUOTA, Sizing, check_complete, run_grpc
from bench.llama_server import API_KEY, REQUEST_EXTRA, ServerConfig, started
from bench.online import MAX_CONCURRENCY, poisson_arrivals
from bench.traces import RequestTrace, summarize

SUITE = "online_http"
ROUNDS = 3
POISSON_FRACTION = 0.7
FULL = (100, 128, 64)  # requests, mean prompt tokens, mean output tokens
QUICK = (12, 32, 8)
LLAMA_TENANTS = ("llama-a", "llama-b", "llama-c")  # one SDK client each, as kvfence's tenants
LLAMA_KEYS = dict.fromkeys(LLAMA_TENANTS, API_KEY)
LLAMA_MODEL = "llama"


@asynccontextmanager
async def both_fronts(
    loaded: Any, tenants: Sequence[str], sizing: Sizing | None = None
) -> AsyncIterator[tuple[str, str, dict[str, str]]]:
    """One in-process server with gRPC and HTTP on; yields (gRPC target, HTTP base URL, keys)."""
    from service.admission.tenants import Quotas, Tenant, TenantRegistry, hash_key, new_api_key
    from service.serve.app import build_server
    from service.serve.kvfence_server import ServerOptions
    from service.telemetry.logs import make_logger

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


def _entry(front: str, label: str, rate: float | None, wall: float,
           traces: list[RequestTrace], round_: int | None = None) -> dict[str, Any]:
    overall = summarize(traces, wall)
    tag = "" if round_ is None else f" round {round_}"
    print(f"[{SUITE}]{tag} {front} rate={label}: {overall['req_s']:.2f} req/s, "
          f"{overall['output_tok_s']:.1f} out tok/s, TTFT p50 {overall['ttft_p50_ms']:.0f} ms",
          flush=True)
    return {"front": front, "rate": label, "request_rate": rate, "round": round_,
            "overall": overall}


def json_schema(max_tokens: int) -> dict[str, Any]:
    """An object whose one string is too long to close within ``max_tokens`` tokens, so the
    constraint (not an early stop) shapes every token and the output length matches the
    unconstrained run's."""
    return {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 64 * max_tokens}},
        "required": ["text"],
        "additionalProperties": False,
    }


def _tenants(prefix: str, count: int, tag: object) -> tuple[str, ...]:
    return tuple(f"{prefix}-{chr(ord('a') + i)}{tag}" for i in range(count))


def _llama_sweep(
    gguf: Path, work: Sequence[Work], quick: bool, cores: tuple[set[int], set[int]],
    scratch: Path, errors: dict[str, str],
) -> tuple[ServerConfig | None, dict[str, float]]:
    """llama-server's slots (then physical batch) swept by one capacity run each on the first
    quarter of the work, on the server's cores, its client in a process of its own."""
    server_cpus, client_cpus = cores
    part = list(work[: max(1, len(work) // 4)])
    log = scratch / "llama-server.log"

    def measure(config: ServerConfig) -> float:
        with started(config, gguf, log, server_cpus) as base_url:
            s = front_load.spec("http", base_url, LLAMA_KEYS, part, LLAMA_TENANTS,
                                model=LLAMA_MODEL, extra_body=REQUEST_EXTRA,
                                max_concurrency=MAX_CONCURRENCY)
            wall, traces = asyncio.run(front_load.in_own_process(s, scratch, client_cpus))
        check_complete(part, traces)
        return float(summarize(traces, wall)["output_tok_s"])

    threads = len(server_cpus)
    return llama_server.sweep(llama_server.QUICK_SLOTS if quick else llama_server.SLOTS,
                              () if quick else llama_server.UBATCHES, threads, measure, errors)


def workload(quick: bool, vocab: int) -> tuple[list[Work], list[Work]]:
    """(measured work, warm-up work)."""
    n, inp, out = QUICK if quick else FULL
    return (random_work(0, n, (inp // 2, inp * 3 // 2), (out // 2, out * 3 // 2), vocab),
            random_work(1, 6, (inp // 2, inp), (2, 4), vocab))


async def _runs(
    loaded: Any, work: list[Work], warm: list[Work], cores: tuple[set[int], set[int]],
    best: ServerConfig | None, llama_url: str | None,
) -> list[dict[str, Any]]:
    """kvfence's fronts and, where ``llama_url`` is up, llama-server at its ``best`` setting,
    in the same interleaved rounds."""
    server_cpus, client_cpus = cores
    n = len(work)
    schema = {"type": "json_schema",
              "json_schema": {"name": "bench", "schema": json_schema(max(w.max_tokens for w in work))}}
    # Every run gets tenants of its own: no run hits another's prefix cache.
    plans = {r: {"grpc": _tenants("grpc", 3, r), "http": _tenants("http", 3, r),
                 "free": _tenants("free", 2, r), "json": _tenants("json", 2, r),
                 "pgrpc": _tenants("pgrpc", 3, r), "phttp": _tenants("phttp", 3, r)}
             for r in (*range(ROUNDS), "w")}
    tenants = tuple(t for plan in plans.values() for ts in plan.values() for t in ts)
    model = loaded.name
    runs: list[dict[str, Any]] = []
    async with both_fronts(loaded, tenants) as (target, base_url, keys):
        pin_process(server_cpus)  # again: the server's threads have started since
        await run_grpc(target, keys, warm, plans["w"]["grpc"])
        await run_http(base_url, keys, warm, plans["w"]["http"], model=model)
        await run_http(base_url, keys, warm, plans["w"]["json"], model=model,
                       response_format=schema)
        if llama_url is not None:
            await run_http(llama_url, LLAMA_KEYS, warm, LLAMA_TENANTS, model=LLAMA_MODEL,
                           extra_body=REQUEST_EXTRA)
        with tempfile.TemporaryDirectory() as scratch:

            async def load(front: str, who: Sequence[str], **kw: Any) -> tuple[float, Any]:
                if front == "llama":
                    assert llama_url is not None
                    s = front_load.spec("http", llama_url, LLAMA_KEYS, work, who,
                                        model=LLAMA_MODEL, extra_body=REQUEST_EXTRA, **kw)
                else:
                    address = target if front == "grpc" else base_url
                    extra = {} if front == "grpc" else {"model": model}
                    s = front_load.spec(front, address, keys, work, who, **extra, **kw)
                return await front_load.in_own_process(s, Path(scratch), client_cpus)

            def capacity_runs(t: Mapping[str, Sequence[str]]) -> Any:
                return (("grpc", "gRPC", t["grpc"], {}),
                        ("http", "HTTP", t["http"], {}),
                        ("http", "HTTP unconstrained", t["free"], {}),
                        ("http", "HTTP json_schema", t["json"], {"response_format": schema}),
                        *([("llama", best.label, LLAMA_TENANTS, {})] if best else []))

            # One untimed round at full shape first: the first capacity run through a front
            # in a fresh server pays one-time costs (32 connections opened, buffers grown).
            # NOTE: measured without it: HTTP / gRPC 0.928 in round 0, 0.992 and 1.023 after.
            for front, _, who, kw in capacity_runs(plans["w"]):
                await load(front, who, max_concurrency=MAX_CONCURRENCY, **kw)
            for r in range(ROUNDS):  # interleaved: drifting machine load hits every front alike
                for front, label, who, kw in capacity_runs(plans[r]):
                    wall, traces = await load(front, who, max_concurrency=MAX_CONCURRENCY, **kw)
                    check_complete(work, traces)
                    runs.append(_entry(label, "inf", None, wall, traces, r))
            capacity = statistics.median(
                x["overall"]["req_s"] for x in runs if x["front"] == "gRPC")
            rate = POISSON_FRACTION * capacity
            arrivals = poisson_arrivals(rate, n, seed=1)
            poisson = [("grpc", "gRPC", "pgrpc"), ("http", "HTTP", "phttp")]
            if best is not None:
                poisson.append(("llama", best.label, ""))
            for r in range(ROUNDS):
                for front, label, plan in poisson:
                    who = plans[r][plan] if plan else LLAMA_TENANTS
                    wall, traces = await load(front, who, arrivals=arrivals)
                    check_complete(work, traces)
                    runs.append(_entry(label, f"{rate:.2f}", rate, wall, traces, r))
    return runs


def ratios(runs: Sequence[Mapping[str, Any]], num: str, den: str) -> list[float]:
    """Per round, output tok/s of front ``num`` over front ``den`` (capacity runs)."""
    tok_s = {(r["front"], r["round"]): r["overall"]["output_tok_s"] for r in runs
             if r["rate"] == "inf"}
    rounds = sorted({rd for _, rd in tok_s})
    return [tok_s[(num, rd)] / tok_s[(den, rd)] for rd in rounds]


POISSON_FIGURES = (("out tok/s", "output_tok_s"), ("TTFT p50", "ttft_p50_ms"),
                   ("TTFT p99", "ttft_p99_ms"), ("ITL p50", "itl_p50_ms"), ("ITL p99", "itl_p99_ms"))


def llama_note(sweep: Mapping[str, float], best: ServerConfig, n: int) -> str:
    """The llama-server sweep in one line, fastest first."""
    ranked = sorted(sweep.items(), key=lambda kv: -kv[1])
    return (f"llama-server: {best.label} was the fastest in a sweep of one capacity run each on "
            f"the first {max(1, n // 4)} requests (output tok/s: "
            + ", ".join(f"{label.removeprefix('llama-server ')} {v:.1f}" for label, v in ranked)
            + "); it runs on the server's cores, driven by the same client process as the "
            "HTTP front, with `cache_prompt: false`.")


def poisson_rows(
    runs: Sequence[Mapping[str, Any]], fronts: Sequence[str] = ("gRPC", "HTTP")
) -> list[tuple[Any, ...]]:
    """One row per front of its Poisson rounds: each figure as median [min–max]."""
    rows = []
    for front in fronts:
        mine = [r["overall"] for r in runs if r["front"] == front and r["rate"] != "inf"]
        rows.append((front, *(str(spread(o[key] for o in mine)) for _, key in POISSON_FIGURES)))
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import load_kvfence

    server_cpus, client_cpus = split_cores()
    pin_process(server_cpus)
    threads = min(bench_threads(), len(server_cpus))
    out = results_dir(quick)
    set_torch_threads(threads)
    gguf = default_model_file()
    loaded = load_kvfence(gguf)
    work, warm = workload(quick, loaded.model.config.vocab_size)
    cores = (server_cpus, client_cpus)
    errors: dict[str, str] = {}
    try:
        with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as peer:
            best, sweep = _llama_sweep(gguf, work, quick, cores, Path(scratch), errors)
            # The best llama-server stays up (idle while kvfence runs) so its rounds
            # interleave with kvfence's: machine drift hits both alike.
            llama_url = None if best is None else peer.enter_context(
                started(best, gguf, Path(scratch) / "llama-server.log", server_cpus))
            runs = asyncio.run(_runs(loaded, work, warm, cores, best, llama_url))
    finally:
        pin_process(server_cpus | client_cpus)  # the suites after this one get every core
    http_vs_grpc = ratios(runs, "HTTP", "gRPC")
    json_vs_free = ratios(runs, "HTTP json_schema", "HTTP unconstrained")
    http_vs_llama = ratios(runs, "HTTP", best.label) if best else []
    targets = [
        worst_target("HTTP / gRPC output tok/s (same load, capacity)", spread(http_vs_grpc), 0.95),
        worst_target("JSON-schema-constrained / unconstrained output tok/s (HTTP)",
                     spread(json_vs_free), 0.90),
        *([worst_target(f"kvfence HTTP / {best.label} output tok/s (same client, capacity)",
                        spread(http_vs_llama), 1.0)] if best else []),
    ]
    cols = ("front", "round", "rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
            "ITL p50", "ITL p99")
    rows = [(r["front"], "-" if r["round"] is None else r["round"], r["rate"],
             r["overall"]["req_s"], r["overall"]["output_tok_s"],
             r["overall"]["ttft_p50_ms"], r["overall"]["ttft_p99_ms"], r["overall"]["tpot_p50_ms"],
             r["overall"]["itl_p50_ms"], r["overall"]["itl_p99_ms"]) for r in runs]
    md = "\n\n".join([
        f"# Online serving: HTTP (OpenAI API) vs gRPC{' (quick)' if quick else ''}",
        f"{runs[0]['overall']['requests']} requests per run; {ROUNDS} interleaved rounds of the "
        f"capacity runs (rate `inf` = at most {MAX_CONCURRENCY} in flight), then {ROUNDS} rounds "
        f"of one Poisson run per front at {POISSON_FRACTION} x the median gRPC capacity. HTTP is "
        f"driven by the `openai` SDK; each run's client is a process of its own "
        f"(bench/front_load.py). The server runs on cores {sorted(server_cpus)} ({threads} "
        f"threads), the clients on {sorted(client_cpus)}. The constrained runs ask for a JSON "
        f"schema whose string cannot close within max_tokens. Each ratio is taken per round; "
        f"targets are judged on the worst round. Times in ms.",
        targets_table(targets),
        "Ratios per round: HTTP / gRPC " + ", ".join(f"{v:.3f}" for v in http_vs_grpc)
        + "; constrained / unconstrained " + ", ".join(f"{v:.3f}" for v in json_vs_free)
        + (f"; HTTP / {best.label} " + ", ".join(f"{v:.3f}" for v in http_vs_llama)
           if best else "") + ".",
        *([llama_note(sweep, best, len(work))] if best else []),
        "Poisson rounds, median [min–max]:",
        md_table(("front", *(name for name, _ in POISSON_FIGURES)),
                 poisson_rows(runs, ("gRPC", "HTTP", *([best.label] if best else [])))),
        md_table(cols, rows),
        *(f"**error** {name}: {msg}" for name, msg in errors.items()),
    ])
    data = {"suite": SUITE, "quick": quick, "machine": machine_info(threads), "runs": runs,
            "ratios": {"http_vs_grpc": spread(http_vs_grpc).as_dict(),
                       "json_schema_vs_free": spread(json_vs_free).as_dict(),
                       **({"http_vs_llama_server": spread(http_vs_llama).as_dict()}
                          if best else {})},
            "llama_server_sweep": sweep, "llama_server_best": best.label if best else None,
            "errors": errors,
            "cores": {"server": sorted(server_cpus), "clients": sorted(client_cpus)},
            "targets": [t.as_dict() for t in targets]}
    write_suite(out, SUITE, data, md)
    return data
