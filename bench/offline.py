"""Suite 1, offline throughput: kvfence (in process, over gRPC) vs transformers and llama.cpp.

64 requests (seed 0): prompts of U[16,256] random token ids, outputs of U[16,128] tokens with
ignore_eos, greedy. Every system runs the same list after its own warm-up pass; output tok/s
counts each request's own output length only (see hf_peer for the padded static batches).
"""

from __future__ import annotations

import asyncio
import gc
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from bench.common import (
    Target,
    Throughput,
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
    throughput,
    write_suite,
)

SUITE = "offline"
HF_BATCHES = (8, 32)
LLAMA_SEQS = (1, 8, 16, 32)
TENANT = "bench"


def workload(quick: bool, vocab: int) -> tuple[list[Work], list[Work]]:
    """(measured work, warm-up work); quick mode shrinks both."""
    if quick:
        return random_work(0, 8, (16, 64), (4, 16), vocab), random_work(
            1, 2, (16, 32), (2, 4), vocab
        )
    return random_work(0, 64, (16, 256), (16, 128), vocab), random_work(
        1, 8, (16, 256), (4, 8), vocab
    )


def _attempt(
    name: str, fn: Callable[[], Throughput], runs: list[Throughput], errors: dict[str, str]
) -> None:
    print(f"[{SUITE}] {name} ...", flush=True)
    try:
        r = fn()
        runs.append(r)
        print(f"[{SUITE}]   {r.output_tok_s:.1f} output tok/s ({r.wall_s:.1f}s)", flush=True)
    except Exception as err:  # one broken system must not lose the others' numbers
        errors[name] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    finally:
        gc.collect()


def _kvfence_runs(
    loaded: Any, work: list[Work], warm: list[Work], runs: list[Throughput], errors: dict[str, str]
) -> None:
    from bench.kvfence_runner import (
        check_complete,
        grpc_server,
        run_engine,
        run_grpc,
        started_engine,
    )

    def in_process() -> Throughput:
        with started_engine(loaded) as engine:
            asyncio.run(run_engine(engine, warm, (TENANT,)))
            wall, traces = asyncio.run(run_engine(engine, work, (TENANT,)))
        check_complete(work, traces)
        return throughput(
            "kvfence engine", work, wall, "engine API, all requests submitted at once"
        )

    async def over_grpc() -> Throughput:
        async with grpc_server(loaded, (TENANT,)) as (target, keys, _):
            await run_grpc(target, keys, warm, (TENANT,))
            wall, traces = await run_grpc(target, keys, work, (TENANT,))
        check_complete(work, traces)
        return throughput("kvfence gRPC", work, wall, "AsyncClient, all requests concurrent")

    _attempt("kvfence engine", in_process, runs, errors)
    _attempt("kvfence gRPC", lambda: asyncio.run(over_grpc()), runs, errors)


def _peer_runs(
    dtype: torch.dtype,
    work: list[Work],
    warm: list[Work],
    threads: int,
    runs: list[Throughput],
    errors: dict[str, str],
) -> None:
    from bench.hf_peer import generate_batch, load_hf_model, run_static
    from bench.llamacpp_peer import LlamaCppRunner, run_llamacpp

    gguf = default_model_file()
    try:
        model = load_hf_model(gguf, dtype)
        generate_batch(model, warm)
        for b in HF_BATCHES:

            def static(b: int = b, m: Any = model) -> Throughput:
                return run_static(m, work, b)

            _attempt(f"transformers b={b}", static, runs, errors)
        del model
    except Exception as err:
        errors["transformers"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    for n in LLAMA_SEQS:

        def llama(n: int = n) -> Throughput:
            runner = LlamaCppRunner(gguf, n, threads)
            try:
                runner.generate(warm)
                return run_llamacpp(runner, work)
            finally:
                runner.close()

        _attempt(f"llama.cpp n_seq={n}", llama, runs, errors)


def _best(runs: list[Throughput], prefix: str) -> Throughput | None:
    found = [r for r in runs if r.system.startswith(prefix)]
    return max(found, key=lambda r: r.output_tok_s) if found else None


def run(quick: bool = False) -> dict[str, Any]:
    threads = bench_threads()
    set_torch_threads(threads)
    gguf = default_model_file()
    work, warm = workload(quick, gguf_vocab_size(gguf))
    runs: list[Throughput] = []
    errors: dict[str, str] = {}
    dtype = torch.float32
    sizing: dict[str, Any] = {}
    try:
        from bench.kvfence_runner import Sizing, load_kvfence

        sizing = asdict(Sizing())
        loaded = load_kvfence(gguf)
        dtype = loaded.dtype
        _kvfence_runs(loaded, work, warm, runs, errors)
        del loaded
    except ImportError as err:
        errors["kvfence"] = f"ImportError: {err}"
    _peer_runs(dtype, work, warm, threads, runs, errors)
    return report(runs, errors, quick, threads, dtype, work, sizing)


def report(
    runs: list[Throughput],
    errors: dict[str, str],
    quick: bool,
    threads: int,
    dtype: torch.dtype,
    work: list[Work],
    sizing: dict[str, Any],
) -> dict[str, Any]:
    out = results_dir(quick)
    kv = _best(runs, "kvfence engine")
    grpc = _best(runs, "kvfence gRPC")
    peers = {
        "llama.cpp best": _best(runs, "llama.cpp"),
        "transformers best": _best(runs, "transformers"),
    }
    targets: list[Target] = []
    ratios: dict[str, float] = {}
    if kv is not None:
        for r in runs:
            ratios[r.system] = kv.output_tok_s / r.output_tok_s
        for label, peer in peers.items():
            if peer is not None:
                targets.append(
                    Target(
                        f"offline output tok/s vs {label} ({peer.system})",
                        kv.output_tok_s / peer.output_tok_s,
                        2.0,
                    )
                )
        if grpc is not None:
            targets.append(
                Target("gRPC / in-process output tok/s", grpc.output_tok_s / kv.output_tok_s, 0.95)
            )
    rows = [
        (
            r.system,
            r.output_tok_s,
            r.total_tok_s,
            r.wall_s,
            f"{ratios[r.system]:.2f}" if r.system in ratios else "-",
            r.notes,
        )
        for r in runs
    ]
    plot = bar_plot(
        out,
        f"{SUITE}_throughput",
        [r.system for r in runs],
        [r.output_tok_s for r in runs],
        "Offline output throughput",
        "output tok/s",
    )
    md = "\n\n".join(
        [
            f"# Offline throughput{' (quick)' if quick else ''}",
            f"{len(work)} requests, {sum(len(w.prompt_ids) for w in work)} prompt and "
            f"{sum(w.max_tokens for w in work)} output tokens; greedy, ignore_eos; {threads} threads; "
            f"dtype {str(dtype).removeprefix('torch.')} (kvfence, transformers), Q4_1 (llama.cpp).",
            md_table(
                (
                    "system",
                    "output tok/s",
                    "total tok/s",
                    "wall s",
                    "kvfence engine / system",
                    "notes",
                ),
                rows,
            ),
            targets_table(targets),
            f"![throughput]({plot})",
            *(f"**error** {name}: {msg}" for name, msg in errors.items()),
        ]
    )
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "dtype": str(dtype),
        "kvfence_sizing": sizing,
        "runs": [r.as_dict() for r in runs],
        "ratios_kvfence_over": ratios,
        "targets": targets,
        "errors": errors,
    }
    write_suite(out, SUITE, data, md)
    return data
