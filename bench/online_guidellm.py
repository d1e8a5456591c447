"""Suite: GuideLLM (a peer's benchmark tool) drives kvfence's OpenAI HTTP front, and the gRPC
client drives the same load on the same server, so the two fronts are compared side by side.

One in-process server with both fronts on. The load is the gRPC online suite's shape (random
prompts of 128 tokens and outputs of 64, range ratio 0.5, ignore_eos), written as text, and
sampled at temperature 1 on both fronts (GuideLLM sends no temperature; OpenAI's default is 1):
GuideLLM reads the prompts and output lengths from a JSON-lines file (``prompt``,
``output_tokens_count``) and sends streaming ``/v1/completions`` with ``max_tokens``,
``ignore_eos`` and ``stream_options.continuous_usage_stats``, exactly as it does against vLLM;
the gRPC run (``bench.grpc_load``) sends the same texts and output lengths. Both load
generators run as their own processes: a client inside the server's process would take its
interpreter time from the server, and only the gRPC one would. First at most 32 in flight (GuideLLM's
``concurrent`` profile), then Poisson arrivals at 0.7x the gRPC capacity (GuideLLM's
``poisson`` profile; its own arrival draws, the same rate). Each run repeats in 3 interleaved
rounds and has its own tenant, so no run hits another's prefix cache; the ratios are taken
per round and judged on the worst.

GuideLLM needs a Hugging Face tokenizer directory: the suite writes one from the GGUF's own
tokenizer (``tokenizers`` -> ``PreTrainedTokenizerFast.save_pretrained``), and runs GuideLLM
with the Hugging Face hub and datasets offline, so nothing is fetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

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
from bench.kvfence_runner import run_grpc
from bench.online import MAX_CONCURRENCY
from bench.online_http import both_fronts, run_http

SUITE = "online_guidellm"
ROUNDS = 3
POISSON_FRACTION = 0.7
FULL = (100, 128, 64)  # requests, mean prompt tokens, mean output tokens
QUICK = (12, 32, 8)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def export_tokenizer(tokenizer: Any, directory: Path) -> Path:
    """The served model's tokenizer as a Hugging Face directory (what GuideLLM loads)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)  # type: ignore[no-untyped-call]
    fast.save_pretrained(directory)
    return directory


def write_dataset(path: Path, texts: Sequence[str], work: Sequence[Work]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for text, w in zip(texts, work, strict=True):
            f.write(json.dumps({"prompt": text, "output_tokens_count": w.max_tokens}) + "\n")
    return path


async def _subprocess(
    argv: Sequence[str], out_json: Path, env: dict[str, str], cpus: set[int]
) -> Any:
    """Run a load generator as its own process (this loop keeps serving); its JSON output,
    with ``client_cpu_s`` (the generator's CPU time, its worker processes included) added."""
    client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = await asyncio.create_subprocess_exec(
        *argv, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    # Set at once, before it imports anything: its threads and worker processes inherit it.
    os.sched_setaffinity(proc.pid, cpus)
    output, _ = await proc.communicate()
    client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0 or not out_json.exists():
        tail = output.decode("utf-8", "replace").strip().splitlines()[-15:]
        raise RuntimeError(f"{argv[2]} exited {proc.returncode}:\n" + "\n".join(tail))
    result = json.loads(out_json.read_text())
    result["client_cpu_s"] = (client1.ru_utime + client1.ru_stime
                              - client0.ru_utime - client0.ru_stime)
    return result


class CpuClock:
    """Samples this process's CPU time against the wall clock, so the server's CPU can be
    read for exactly the window its requests were in flight: a load generator's start-up
    (GuideLLM's takes seconds) is not charged to the front it drives."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.samples: list[tuple[float, float]] = []
        self._period = period_s
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> CpuClock:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            self.samples.append((time.time(), time.process_time()))
            await asyncio.sleep(self._period)

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds used between two ``time.time()`` instants (linear between samples)."""
        return float(self._at(end) - self._at(start))

    def _at(self, when: float) -> float:
        walls = [w for w, _ in self.samples]
        cpus = [c for _, c in self.samples]
        return float(np.interp(when, walls, cpus))


async def run_guidellm(
    base_url: str, api_key: str, model: str, tokenizer_dir: Path, data: Path, profile: str,
    count: int, out_json: Path, cpus: set[int],
) -> dict[str, Any]:
    """One ``guidellm run``; its JSON report."""
    backend = (f"kind=openai_http,target={base_url.removesuffix('/v1')},api_key={api_key},"
               f"model={model},request_format=/v1/completions")
    argv = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", backend,
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--data", f"kind=json_file,path={data}",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={count}",
        "--output", f"kind=json,path={out_json}",
        "--disable-console",
    ]
    report: dict[str, Any] = await _subprocess(argv, out_json, OFFLINE, cpus)
    return report


async def run_grpc_load(
    target: str, api_key: str, data: Path, out_json: Path, cpus: set[int], *,
    concurrency: int | None = None, rate: float | None = None,
) -> dict[str, Any]:
    """``bench.grpc_load`` over the same prompts file; ``summarize``'s dict."""
    argv = [sys.executable, "-m", "bench.grpc_load", target, api_key, str(data), str(out_json)]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    if rate is not None:
        argv += ["--rate", f"{rate:.4f}"]
    summary: dict[str, Any] = await _subprocess(argv, out_json, {}, cpus)
    return summary


def sent_rate(starts: Sequence[float]) -> float:
    """Requests sent per second, first send to last (shows whether arrivals kept the rate)."""
    span = max(starts) - min(starts)
    return (len(starts) - 1) / span if span > 0 else float("inf")


def guidellm_summary(report: dict[str, Any], work: Sequence[Work]) -> dict[str, Any]:
    """GuideLLM's own figures in ``bench.traces.summarize``'s keys. Raises on any errored or
    cut request, or one whose output is not exactly its ``max_tokens`` (as ``check_complete``
    does for gRPC). GuideLLM's Poisson profile may stop one request short of ``max_requests``:
    at most one missing request is allowed, and the rates count what was sent."""
    (bench,) = report["benchmarks"]
    m = bench["metrics"]
    totals = m["request_totals"]
    done = bench["requests"]["successful"]
    short = [r for r in done
             if r["output_tokens"] != json.loads(r["request_args"])["body"]["max_tokens"]]
    if totals["errored"] or totals["incomplete"] or short or not 0 <= len(work) - len(done) <= 1:
        raise RuntimeError(f"guidellm: {totals} requests of {len(work)}, "
                           f"{len(short)} with outputs not of their max_tokens")
    out_tokens = sum(int(r["output_tokens"]) for r in done)
    # First request sent to last one finished, as the gRPC side's wall time is measured.
    timings = [r["info"]["timings"] for r in done]
    starts = [t["request_start"] for t in timings]
    wall = max(t["request_end"] for t in timings) - min(starts)

    def pct(name: str, q: str) -> float:
        return float(m[name]["successful"]["percentiles"][q])

    return {
        "requests": totals["total"],
        "completed": len(done),
        "wall_s": wall,
        "req_s": len(done) / wall,
        "sent_req_s": sent_rate(starts),
        "window_unix": [min(starts), max(t["request_end"] for t in timings)],
        "output_tok_s": out_tokens / wall,
        "output_tokens": out_tokens,
        "ttft_p50_ms": pct("time_to_first_token_ms", "p50"),
        "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
        "tpot_p50_ms": pct("time_per_output_token_ms", "p50"),
        "itl_p50_ms": pct("inter_token_latency_ms", "p50"),
        "itl_p99_ms": pct("inter_token_latency_ms", "p99"),
    }


GRPC, HTTP = "gRPC (kvfence client)", "HTTP (GuideLLM)"


def _entry(front: str, label: str, rate: float | None, overall: dict[str, Any],
           round_: int) -> dict[str, Any]:
    print(f"[{SUITE}] round {round_} {front} rate={label}: {overall['req_s']:.2f} req/s, "
          f"{overall['output_tok_s']:.1f} out tok/s, TTFT p50 {overall['ttft_p50_ms']:.0f} ms",
          flush=True)
    return {"front": front, "rate": label, "request_rate": rate, "round": round_,
            "overall": overall}


def per_round(runs: Sequence[dict[str, Any]], key: str, num: str, den: str) -> list[float]:
    """Per round, the capacity runs' ``key`` of front ``num`` over front ``den``."""
    at = {(r["front"], r["round"]): r["overall"][key] for r in runs if r["rate"] == "inf"}
    rounds = sorted({rd for _, rd in at})
    return [float(at[(num, rd)] / at[(den, rd)]) for rd in rounds]


async def _runs(
    loaded: Any, quick: bool, scratch: Path, cores: tuple[set[int], set[int]]
) -> list[dict[str, Any]]:
    server_cpus, client_cpus = cores
    n, inp, out = QUICK if quick else FULL
    vocab = loaded.model.config.vocab_size
    work = random_work(0, n, (inp // 2, inp * 3 // 2), (out // 2, out * 3 // 2), vocab)
    texts = [loaded.tokenizer.decode(w.prompt_ids) for w in work]
    warm = random_work(1, 6, (inp // 2, inp), (2, 4), vocab)
    data = write_dataset(scratch / "prompts.jsonl", texts, work)
    tokenizer_dir = export_tokenizer(loaded.tokenizer, scratch / "tokenizer")
    kinds = ("grpc-cap", "http-cap", "grpc-poisson", "http-poisson")
    tenants = (*(f"{k}-{r}" for r in range(ROUNDS) for k in kinds), "warm")
    model = loaded.name
    runs: list[dict[str, Any]] = []

    async def guidellm(tenant: str, profile: str) -> dict[str, Any]:
        report = await run_guidellm(base_url, keys[tenant], model, tokenizer_dir, data, profile,
                                    n, scratch / f"{tenant}.json", client_cpus)
        return {**guidellm_summary(report, work), "client_cpu_s": report["client_cpu_s"]}

    async with both_fronts(loaded, tenants) as (target, base_url, keys), CpuClock() as clock:
        pin_process(server_cpus)  # again: the server's threads have started since
        await run_grpc(target, keys, warm, ("warm",))
        await run_http(base_url, keys, warm, ("warm",), model=model)
        for r in range(ROUNDS):  # interleaved: drifting machine load hits both fronts alike
            overall = await run_grpc_load(target, keys[f"grpc-cap-{r}"], data,
                                          scratch / f"grpc-cap-{r}.json", client_cpus,
                                          concurrency=MAX_CONCURRENCY)
            runs.append(_entry(GRPC, "inf", None, overall, r))
            overall = await guidellm(f"http-cap-{r}", f"kind=concurrent,streams={MAX_CONCURRENCY}")
            runs.append(_entry(HTTP, "inf", None, overall, r))
        rate = POISSON_FRACTION * float(np.median(
            [x["overall"]["req_s"] for x in runs if x["front"] == GRPC]))
        for r in range(ROUNDS):
            overall = await run_grpc_load(target, keys[f"grpc-poisson-{r}"], data,
                                          scratch / f"grpc-poisson-{r}.json", client_cpus,
                                          rate=rate)
            runs.append(_entry(GRPC, f"{rate:.2f}", rate, overall, r))
            overall = await guidellm(f"http-poisson-{r}", f"kind=poisson,rate={rate:.4f}")
            runs.append(_entry(HTTP, f"{rate:.2f}", rate, overall, r))
    for entry in runs:
        o = entry["overall"]
        o["server_cpu_s"] = clock.cpu_between(*o["window_unix"])
        o["server_cpu_ms_per_token"] = 1000 * o["server_cpu_s"] / o["output_tokens"]
    return runs


def run(quick: bool = False) -> dict[str, Any]:
    from bench.kvfence_runner import load_kvfence

    server_cpus, client_cpus = split_cores()
    pin_process(server_cpus)
    threads = min(bench_threads(), len(server_cpus))
    out = results_dir(quick)
    set_torch_threads(threads)
    loaded = load_kvfence(default_model_file())
    try:
        with tempfile.TemporaryDirectory(prefix="kvfence-guidellm-") as scratch:
            runs = asyncio.run(_runs(loaded, quick, Path(scratch), (server_cpus, client_cpus)))
    finally:
        pin_process(server_cpus | client_cpus)  # the suites after this one get every core
    tok_s = spread(per_round(runs, "output_tok_s", HTTP, GRPC))
    # On a machine with few cores the load generators' own CPU shows in tok/s; the server's
    # CPU per token is the front's cost without it.
    cpu = spread(per_round(runs, "server_cpu_ms_per_token", GRPC, HTTP))
    targets = [
        worst_target("HTTP (GuideLLM) / gRPC output tok/s (same load, capacity)", tok_s, 0.95),
        worst_target("gRPC / HTTP server CPU per output token (capacity)", cpu, 0.95),
    ]
    cols = ("front", "round", "rate", "sent req/s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
            "ITL p50", "ITL p99", "client CPU s", "server CPU ms/token")
    rows = [(r["front"], r["round"], r["rate"], r["overall"]["sent_req_s"], r["overall"]["req_s"], r["overall"]["output_tok_s"],
             r["overall"]["ttft_p50_ms"], r["overall"]["ttft_p99_ms"], r["overall"]["tpot_p50_ms"],
             r["overall"]["itl_p50_ms"], r["overall"]["itl_p99_ms"], r["overall"]["client_cpu_s"],
             r["overall"]["server_cpu_ms_per_token"]) for r in runs]
    import guidellm.version

    md = "\n\n".join([
        f"# Online serving: GuideLLM on the HTTP front vs gRPC{' (quick)' if quick else ''}",
        f"{runs[0]['overall']['requests']} requests per run, the same prompt texts and output "
        f"lengths on both fronts; rate `inf` = at most {MAX_CONCURRENCY} in flight (GuideLLM "
        f"`concurrent`); the other rate is Poisson at {POISSON_FRACTION} x the gRPC capacity. "
        f"HTTP figures are GuideLLM {guidellm.version.version}'s own (its JSON report); gRPC "
        f"figures are the kvfence client's. The server runs on cores {sorted(server_cpus)} "
        f"({threads} threads), the load generators on {sorted(client_cpus)}. {ROUNDS} interleaved "
        f"rounds of each run, every run with a tenant of its own. Times in ms. "
        "Read `sent req/s` before a Poisson row: GuideLLM 0.8's poisson profile has sent "
        "faster than its rate on short runs here (11.5 req/s for a rate of 4.9).",
        targets_table(targets),
        f"Per round (capacity): HTTP / gRPC output tok/s {tok_s}, gRPC / HTTP server CPU per "
        f"token {cpu}; targets are judged on the worst round.",
        md_table(cols, rows),
    ])
    data = {"suite": SUITE, "quick": quick, "machine": machine_info(threads), "runs": runs,
            "ratios": {"http_vs_grpc_tok_s": tok_s.as_dict(), "server_cpu": cpu.as_dict()},
            "targets": [t.as_dict() for t in targets]}
    write_suite(out, SUITE, data, md)
    return data
