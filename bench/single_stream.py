"""Suite: one request at a time, as a user streaming one completion feels it.

Each run sends greedy requests one at a time (a 32-token random prompt, then 128 tokens with
ignore_eos, llama-bench's tg128; REPS of them, as llama-bench repeats each test, and the run's
figure is their median) to every system in turn: kvfence in process (``--weights auto`` and
``bf16``), kvfence over gRPC (``auto``; the client in a process of its own, as deployed
clients are, and once more in the server's process, where its per-token Python shares the
server's interpreter lock), both again with ``--compile on`` (each start
compiles; inductor's cache makes all but the first quick, and start-up is not in the
figures), llama.cpp with one sequence, and transformers ``generate()`` (dense weights in
kvfence's dtype). The targets are reported for the default and for ``--compile on``. The
second pullable model (gemma-3-270m, Q4_K_M) runs too, over gRPC and in llama.cpp on the same
GGUF file, back to back like the default model's pair (random prompts from its own
vocabulary); its decode ratio to llama.cpp is reported, judged by no target. TTFT is request start to the first token;
decode tok/s is (tokens - 1) over the time from the first token to the last. Runs are
interleaved (run r of every system, then run r + 1) so machine load drifts hit all alike,
and within a run the systems the targets pair (in process, gRPC, llama.cpp) go back to back,
their order reversed every other run (:func:`run_order`); each figure is the median of the runs with min and max, and a target passes only if it
passes in every run.

Each kvfence run starts its own engine (or server) and shuts it down after, and the peers'
runs happen on threads that exit, so while a system runs it is the process's only thread
pool, as in a served process (see service.model.threads: a second live OpenMP pool makes
every parallel op of the engine's step pay a futex wake-up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import (
    Target,
    Work,
    bar_plot,
    bench_threads,
    default_model_file,
    gguf_vocab_size,
    machine_info,
    md_table,
    random_work,
    results_dir,
    set_torch_threads,
    targets_table,
    write_suite,
)
from service.model.threads import on_fresh_thread

SUITE = "single_stream"
PROMPT_TOKENS = 32
# llama-bench repeats each test 5 times; one 128-token decode (~1 s) on a shared VM drifts
# +-10% on its own, and the targets are judged on a run's worst, so a run is 5 repetitions.
# The dense rows (bf16 in process, transformers) are in no target and decode ~15-20 tok/s:
# they run once a run.
REPS = 5


def reps(quick: bool) -> int:
    """Requests a run of each system in the targets (2 in a quick smoke run)."""
    return 2 if quick else REPS
GRPC, INPROC, LLAMA = "kvfence gRPC (auto)", "kvfence in-process (auto)", "llama.cpp n_seq=1"
GRPC_SAME = "kvfence gRPC (auto), client in the server's process"
GRPC_C, INPROC_C = "kvfence gRPC (auto, --compile on)", "kvfence in-process (auto, --compile on)"
SECOND = "gemma-3-270m"  # the second pullable model (service.model.catalog)
GRPC_2, LLAMA_2 = f"kvfence gRPC (auto), {SECOND}", f"llama.cpp n_seq=1, {SECOND}"
NO_COMPILE = "it needs bf16 compute, and kvfence's dtype on this CPU is "


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    decode_tok_s: float


def sample(start: float, token_times: Sequence[float]) -> Sample:
    if len(token_times) < 2:
        raise RuntimeError(f"only {len(token_times)} tokens streamed")
    span = token_times[-1] - token_times[0]
    return Sample(token_times[0] - start, (len(token_times) - 1) / span)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float]) -> str:
    return f"{s['median']:.3g} [{s['min']:.3g}–{s['max']:.3g}]"


def median_sample(samples: Sequence[Sample]) -> Sample:
    """One run's figure from its repetitions: the median TTFT and the median decode rate."""
    if not samples:
        raise RuntimeError("no repetitions")
    return Sample(
        statistics.median(s.ttft_s for s in samples),
        statistics.median(s.decode_tok_s for s in samples),
    )


def _trace_sample(traces: Sequence[Any], work: Sequence[Work]) -> Sample:
    if len(traces) != len(work):
        raise RuntimeError(f"{len(traces)}/{len(work)} requests traced")
    for t, w in zip(traces, work, strict=True):
        if t.output_tokens != w.max_tokens:
            raise RuntimeError(f"{t.output_tokens}/{w.max_tokens} tokens streamed")
    return median_sample([Sample(t.ttft, 1.0 / t.tpot) for t in traces])


def _hf_system(path: Any, dtype: Any) -> Callable[[Sequence[Work]], Sample]:
    import torch

    from bench.hf_peer import load_hf_model

    model = on_fresh_thread(lambda: load_hf_model(path, dtype))

    from transformers import LogitsProcessor

    class Stamp(LogitsProcessor):
        """Records the time of each token: generate() calls it once per step, after the forward."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    def run(w: Work) -> Sample:
        stamp = Stamp()
        ids = torch.tensor([w.prompt_ids])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=w.max_tokens,
                min_new_tokens=w.max_tokens,
                do_sample=False,
                pad_token_id=0,
                logits_processor=[stamp],
            )
        return sample(start, stamp.times)

    def one(ws: Sequence[Work]) -> Sample:
        return on_fresh_thread(lambda: run(ws[0]))  # dense, in no target: once a run

    return one


def _llama_system(path: Any, threads: int) -> Callable[[Sequence[Work]], Sample]:
    from bench.llamacpp_peer import LlamaCppRunner

    runner = LlamaCppRunner(path, 1, threads, max_len=PROMPT_TOKENS + 160)

    def run(w: Work) -> Sample:
        times: list[list[float]] = [[]]
        start = time.perf_counter()
        runner.generate([w], times)
        return sample(start, times[0])

    def one(ws: Sequence[Work]) -> Sample:
        return median_sample([on_fresh_thread(lambda w=w: run(w)) for w in ws])

    return one


async def _measure(quick: bool, threads: int) -> tuple[dict[str, list[Sample]], str]:
    import torch

    from bench.kvfence_runner import (
        Sizing,
        grpc_server,
        run_engine,
        run_grpc,
        run_grpc_elsewhere,
        started_engine,
    )
    from service.model import load_model
    from service.model.catalog import ensure_model

    path = default_model_file()
    second_path = ensure_model(SECOND)
    vocab = gguf_vocab_size(path)
    tokens = 32 if quick else 128
    runs = 3
    work = [
        random_work(100 + r, reps(quick), (PROMPT_TOKENS,) * 2, (tokens,) * 2, vocab)
        for r in range(runs + 1)
    ]  # work[0] warms every system up
    second_vocab = gguf_vocab_size(second_path)
    second_work = [
        random_work(300 + r, reps(quick), (PROMPT_TOKENS,) * 2, (tokens,) * 2, second_vocab)
        for r in range(runs + 1)
    ]
    sizing = Sizing(
        max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512, kv_bytes=64 << 20
    )
    auto = load_model(str(path), weights="auto", progress=False)
    dense = load_model(str(path), weights="bf16", progress=False)
    second = load_model(str(second_path), weights="auto", progress=False)
    dtype = str(auto.dtype).removeprefix("torch.")
    samples: dict[str, list[Sample]] = {}

    compiled = dataclasses.replace(sizing, compile="on")

    async def inproc(loaded: Any, ws: Sequence[Work], size: Sizing = sizing) -> Sample:
        with started_engine(loaded, size) as engine:
            _, traces = await run_engine(engine, ws, bypass_prefix_cache=True, max_concurrency=1)
        return _trace_sample(traces, ws)

    async def grpc(
        ws: Sequence[Work], size: Sizing = sizing, same_process: bool = False, loaded: Any = auto
    ) -> Sample:
        client = run_grpc if same_process else run_grpc_elsewhere
        async with grpc_server(loaded, ["bench"], size) as (target, keys, _):
            _, traces = await client(
                target, keys, ws, ["bench"], bypass_prefix_cache=True, max_concurrency=1
            )
        return _trace_sample(traces, ws)

    systems: dict[str, Callable[[Sequence[Work]], Any]] = {
        INPROC: lambda ws: inproc(auto, ws),
        "kvfence in-process (bf16)": lambda ws: inproc(dense, ws[:1]),  # in no target: once
        GRPC: grpc,
        GRPC_SAME: lambda ws: grpc(ws, same_process=True),
        INPROC_C: lambda ws: inproc(auto, ws, compiled),
        GRPC_C: lambda ws: grpc(ws, compiled),
        LLAMA: _llama_system(path, threads),
        "transformers generate": _hf_system(path, auto.dense_weights_dtype),
        GRPC_2: lambda ws: grpc(ws, loaded=second),
        LLAMA_2: _llama_system(second_path, threads),
    }
    if auto.dtype != torch.bfloat16:
        # --compile on refuses to start without bf16 compute (service.engine.compiled).
        print(f"[{SUITE}] --compile rows not run: {NO_COMPILE}{dtype}", flush=True)
        del systems[INPROC_C], systems[GRPC_C]
    for r, ws in enumerate(work):
        for name in run_order(list(systems), r):
            result = systems[name](second_work[r] if name in (GRPC_2, LLAMA_2) else ws)
            got = await result if asyncio.iscoroutine(result) else result
            if r > 0:
                samples.setdefault(name, []).append(got)
                print(
                    f"[{SUITE}] run {r} {name}: TTFT {1000 * got.ttft_s:.1f} ms, "
                    f"{got.decode_tok_s:.1f} tok/s",
                    flush=True,
                )
    return {name: samples[name] for name in systems}, dtype


def run_order(names: Sequence[str], r: int) -> list[str]:
    """Run ``r``'s order: the three systems the targets pair (in process, gRPC, llama.cpp)
    back to back with gRPC in the middle, reversed on even runs so a steady drift of the
    machine's speed favours neither side of a ratio across the runs; then the second
    model's pair (gRPC, llama.cpp) the same way; then the others."""
    core = [n for n in (INPROC, GRPC, LLAMA) if n in names]
    pair = [n for n in (GRPC_2, LLAMA_2) if n in names]
    if r % 2 == 0:
        core, pair = core[::-1], pair[::-1]
    return [*core, *pair, *(n for n in names if n not in core and n not in pair)]


def ratios(num: Sequence[Sample], den: Sequence[Sample]) -> list[float]:
    """Run by run, ``num``'s decode rate over ``den``'s."""
    return [a.decode_tok_s / b.decode_tok_s for a, b in zip(num, den, strict=True)]


def run(quick: bool = False) -> dict[str, Any]:
    threads = bench_threads()
    set_torch_threads(threads)
    out = results_dir(quick)
    samples, dtype = asyncio.run(_measure(quick, threads))
    rows = []
    figures: dict[str, Any] = {}
    for name, got in samples.items():
        ttft = spread([1000 * s.ttft_s for s in got])
        tok_s = spread([s.decode_tok_s for s in got])
        figures[name] = {"ttft_ms": ttft, "decode_tok_s": tok_s, "runs": [vars_of(s) for s in got]}
        rows.append((name, fmt(ttft), fmt(tok_s)))
    llama = samples[LLAMA]
    targets = []
    for label, g_name, i_name in (("", GRPC, INPROC), (" --compile on", GRPC_C, INPROC_C)):
        if g_name not in samples:
            continue
        grpc, inproc = samples[g_name], samples[i_name]
        vs_llama = ratios(grpc, llama)
        overhead = ratios(inproc, grpc)
        targets += [
            Target(f"single-stream gRPC{label} decode vs llama.cpp tg128 (worst run)",
                   min(vs_llama), 1.0),
            Target(f"gRPC{label} per-token time / in-process (worst run)", max(overhead), 1.15,
                   higher_is_better=False),
        ]
    second = spread(ratios(samples[GRPC_2], samples[LLAMA_2]))
    names = list(figures)
    plot = bar_plot(
        out,
        f"{SUITE}_decode",
        names,
        [figures[n]["decode_tok_s"]["median"] for n in names],
        "Single-stream decode (median of runs)",
        "tokens/s",
    )
    md = "\n\n".join(
        [
            f"# Single-stream decode{' (quick)' if quick else ''}",
            f"One request at a time: {PROMPT_TOKENS}-token prompt, greedy; {len(llama)} interleaved "
            f"runs after a warm-up, each the median of {reps(quick)} requests (the "
            f"bf16 and transformers rows: 1); {threads} threads; kvfence dtype {dtype}. The gRPC "
            "client runs in a process of its own (the targets' row), and once more in the "
            "server's process. "
            "Figures: median [min–max]; targets judged on the worst run.",
            md_table(("system", "TTFT ms", "decode tok/s"), rows),
            *([] if GRPC_C in samples else [f"`--compile on` rows not run: {NO_COMPILE}{dtype}."]),
            targets_table(targets),
            f"{SECOND} (Q4_K_M), the same GGUF file in both: kvfence gRPC decode / llama.cpp "
            f"tg (no target): {fmt(second)}.",
            f"![decode]({plot})",
        ]
    )
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "dtype": dtype,
        "systems": figures,
        "targets": targets,
        "second_model": {"model": SECOND, "grpc_decode_vs_llama_cpp": second},
    }
    write_suite(out, SUITE, data, md)
    return data


def vars_of(s: Sample) -> dict[str, float]:
    return {"ttft_s": s.ttft_s, "decode_tok_s": s.decode_tok_s}
