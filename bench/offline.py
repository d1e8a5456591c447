"""Suite 1, offline throughput: kvfence (in process, gRPC, HTTP) vs transformers and llama.cpp.

64 requests (seed 0): prompts of U[16,256] random token ids, outputs of U[16,128] tokens with
ignore_eos, greedy. Every system runs the same list after its own warm-up pass; output tok/s
counts each request's own output length only (see hf_peer for the padded static batches).
Each system is timed ``REPEATS`` times: rows show the median [min–max], and a ratio target
passes only if kvfence's worst run beats the peer's best run by the margin. llama.cpp runs as
``llama-server`` and ``llama-batched-bench`` (bench/offline_llama.py): the server's slots and
physical batch are swept on the first quarter of the work and its best setting is timed in
full, driven like the kvfence HTTP row by the same client.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench import greedy_check, llama_server
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
from bench.llama_server import ServerConfig
from bench.offline_llama import (
    BATCHED_PARALLEL,
    QUICK_PARALLEL,
    BatchedRow,
    run_batched,
    run_server,
)
from service.serve.settings import EngineSizing

SUITE = "offline"
HF_BATCHES = (8, 32)
REPEATS = 3
ENGINE = "kvfence engine"
FAIR = "kvfence engine, served step budget"
FAIR2 = "kvfence engine, served step budget, 2 tenants"
HTTP = "kvfence HTTP"
VARIANT = "kvfence engine, --batch-invariant off"
SAMPLED = 4  # requests per system rerun alone as its greedy reference (greedy_check)
SERVED = EngineSizing()  # the server's defaults: --max-step-ms and --decode-stretch
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
    """Time one system ``REPEATS`` times; every run is kept (rows group them by system)."""
    attempt_rounds([(name, fn)], runs, errors)


def attempt_rounds(
    systems: list[tuple[str, Callable[[], Throughput]]],
    runs: list[Throughput],
    errors: dict[str, str],
) -> None:
    """Time each system ``REPEATS`` times, one run of each per round, so a machine that
    slows down during the suite slows every system alike (their ratios are targets). Odd
    rounds run the systems in reverse order, so neither of two neighbours always runs first
    (where the host drifts within a round, each pays the drift in turn)."""
    broken: set[str] = set()
    for round_ in range(REPEATS):
        for name, fn in systems if round_ % 2 == 0 else systems[::-1]:
            if name in broken:
                continue
            print(f"[{SUITE}] {name} (round {round_ + 1}/{REPEATS}) ...", flush=True)
            try:
                r = fn()
            except Exception as err:  # one broken system must not lose the others' numbers
                errors[name] = f"{type(err).__name__}: {err}"
                broken.add(name)
                traceback.print_exc()
                continue
            finally:
                gc.collect()
            runs.append(r)
            print(f"[{SUITE}]   {r.output_tok_s:.1f} output tok/s ({r.wall_s:.1f}s)", flush=True)


Outputs = dict[str, list[list[int]]]  # system -> every request's ids from its last timed run


def _kvfence_runs(
    loaded: Any,
    variant: Any | None,
    work: list[Work],
    warm: list[Work],
    runs: list[Throughput],
    errors: dict[str, str],
    outputs: Outputs,
    checks: list[greedy_check.Agreement],
) -> None:
    from bench.http_client import run_http
    from bench.kvfence_runner import (
        Sizing,
        check_complete,
        grpc_server,
        run_engine,
        run_grpc,
        started_engine,
    )
    from bench.online_http import both_fronts

    # NOTE: every run bypasses the prefix cache, so repeats of the same prompts stay cold.
    def in_process(
        sizing: Sizing | None = None,
        name: str = ENGINE,
        tenants: tuple[str, ...] = (TENANT,),
        model: Any = loaded,
    ) -> Throughput:
        with started_engine(model, sizing or Sizing()) as engine:
            asyncio.run(run_engine(engine, warm, tenants, bypass_prefix_cache=True))
            wall, traces = asyncio.run(
                run_engine(engine, work, tenants, bypass_prefix_cache=True)
            )
        check_complete(work, traces)
        outputs[name] = [t.token_ids for t in traces]
        note = "engine API, all requests submitted at once"
        if len(tenants) > 1:
            note += f", alternating between {len(tenants)} tenants of weight 1"
        return throughput(name, work, wall, note)

    async def over_grpc() -> Throughput:
        async with grpc_server(loaded, (TENANT,)) as (target, keys, _):
            await run_grpc(target, keys, warm, (TENANT,), bypass_prefix_cache=True)
            wall, traces = await run_grpc(target, keys, work, (TENANT,), bypass_prefix_cache=True)
        check_complete(work, traces)
        outputs["kvfence gRPC"] = [t.token_ids for t in traces]
        return throughput("kvfence gRPC", work, wall, "AsyncClient, all requests concurrent")

    async def over_http() -> Throughput:
        # A fresh server per run and prompts that share no prefix: nothing is cached.
        async with both_fronts(loaded, (TENANT,)) as (_, base_url, keys):
            await run_http(base_url, keys, warm, (TENANT,), model=loaded.name)
            wall, traces = await run_http(base_url, keys, work, (TENANT,), model=loaded.name)
        check_complete(work, traces)
        return throughput(HTTP, work, wall, "openai SDK over /v1/completions, all requests at "
                          "once (the client llama-server gets)")

    # The fair-compute step budget as served: what it costs offline throughput,
    # for one tenant (untimed: nobody to guard) and for two sharing the same requests.
    fair = Sizing(max_step_ms=SERVED.max_step_ms, decode_stretch=SERVED.decode_stretch)
    attempt_rounds(
        [
            (ENGINE, in_process),
            (FAIR, lambda: in_process(fair, FAIR)),
            (FAIR2, lambda: in_process(fair, FAIR2, (TENANT, TENANT + "-2"))),
            ("kvfence gRPC", lambda: asyncio.run(over_grpc())),
            (HTTP, lambda: asyncio.run(over_http())),
            # what batch invariance (the default where it runs) costs: the fast paths' engine
            *([(VARIANT, lambda: in_process(name=VARIANT, model=variant))] if variant else []),
        ],
        runs,
        errors,
    )
    indices = greedy_check.sample(work, SAMPLED)

    def alone() -> list[list[int]]:  # the engine with one request at a time
        refs = []
        with started_engine(loaded, Sizing()) as engine:
            for i in indices:
                _, traces = asyncio.run(
                    run_engine(engine, [work[i]], (TENANT,), bypass_prefix_cache=True)
                )
                refs.append(traces[0].token_ids)
        return refs

    _check(alone, [n for n in (ENGINE, FAIR, FAIR2, "kvfence gRPC") if n in outputs],
           work, indices, outputs, checks, errors)


def _check(
    reference: Callable[[], list[list[int]]],
    systems: list[str],
    work: list[Work],
    indices: list[int],
    outputs: Outputs,
    checks: list[greedy_check.Agreement],
    errors: dict[str, str],
) -> None:
    """Compare each of ``systems``' kept outputs with one reference run of the sample."""
    if not systems:
        return
    print(f"[{SUITE}] greedy reference for {', '.join(systems)} ...", flush=True)
    try:
        refs = reference()
        for name in systems:
            checks.append(greedy_check.agreement(name, work, indices, outputs[name], refs))
    except Exception as err:
        errors[f"greedy check {systems[0]}"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()


def _transformers_runs(
    dtype: torch.dtype,
    gguf: Path,
    work: list[Work],
    warm: list[Work],
    runs: list[Throughput],
    errors: dict[str, str],
    outputs: Outputs,
    checks: list[greedy_check.Agreement],
) -> None:
    from bench.hf_peer import generate_batch, load_hf_model, run_static

    indices = greedy_check.sample(work, SAMPLED)
    try:
        model = load_hf_model(gguf, dtype)
        generate_batch(model, warm)
        for b in HF_BATCHES:

            def static(b: int = b, m: Any = model) -> Throughput:
                return run_static(m, work, b, outputs.setdefault(f"transformers b={b}", []))

            _attempt(f"transformers b={b}", static, runs, errors)

        def alone(m: Any = model) -> list[list[int]]:  # one unpadded row per generate()
            refs: list[list[int]] = []
            for i in indices:
                generate_batch(m, [work[i]], refs)
            return refs

        names = [f"transformers b={b}" for b in HF_BATCHES]
        _check(alone, [n for n in names if outputs.get(n)], work, indices, outputs, checks, errors)
        del model
    except Exception as err:
        errors["transformers"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()


def _llama_runs(
    gguf: Path,
    work: list[Work],
    warm: list[Work],
    threads: int,
    quick: bool,
    runs: list[Throughput],
    errors: dict[str, str],
    sweep: dict[str, float],
    batched: list[BatchedRow],
) -> None:
    """llama-server swept on a quarter of the work, its best setting timed in full; then
    llama-batched-bench. ``sweep`` and ``batched`` receive their figures."""
    part = work[: max(1, len(work) // 4)]
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "llama-server.log"

        def measure(config: ServerConfig) -> float:
            return run_server(config, gguf, part, warm, log).output_tok_s

        best, found = llama_server.sweep(
            llama_server.QUICK_SLOTS if quick else llama_server.SLOTS,
            () if quick else llama_server.UBATCHES, threads, measure, errors,
        )
        sweep.update(found)
        if best is not None:

            def timed(b: ServerConfig = best) -> Throughput:
                return run_server(b, gguf, work, warm, log)

            _attempt(best.label, timed, runs, errors)
    print(f"[{SUITE}] {llama_server.BATCHED_BENCH} ...", flush=True)
    try:
        batched += run_batched(gguf, work, threads, QUICK_PARALLEL if quick else BATCHED_PARALLEL)
    except Exception as err:
        errors[llama_server.BATCHED_BENCH] = f"{type(err).__name__}: {err}"


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict[str, float]) -> str:
    return f"{s['median']:.3g} [{s['min']:.3g}–{s['max']:.3g}]"


def _by_system(runs: list[Throughput]) -> dict[str, list[Throughput]]:
    groups: dict[str, list[Throughput]] = {}
    for r in runs:
        groups.setdefault(r.system, []).append(r)
    return groups


def _rates(runs: list[Throughput], system: str) -> list[float]:
    return [r.output_tok_s for r in runs if r.system == system]


def _best_system(runs: list[Throughput], prefix: str) -> str | None:
    found = [r for r in runs if r.system.startswith(prefix)]
    return max(found, key=lambda r: r.output_tok_s).system if found else None


def run(quick: bool = False) -> dict[str, Any]:
    threads = bench_threads()
    set_torch_threads(threads)
    gguf = default_model_file()
    work, warm = workload(quick, gguf_vocab_size(gguf))
    runs: list[Throughput] = []
    errors: dict[str, str] = {}
    sweep: dict[str, float] = {}
    batched: list[BatchedRow] = []
    outputs: Outputs = {}
    checks: list[greedy_check.Agreement] = []
    dtype = peer_dtype = torch.float32
    sizing: dict[str, Any] = {}
    try:
        from bench.kvfence_runner import Sizing, load_kvfence

        sizing = asdict(Sizing())
        loaded = load_kvfence(gguf)
        # the batch-variant engine, only where the default is invariant (else they are one)
        variant = load_kvfence(gguf, batch_invariant="off") if loaded.batch_invariant else None
        dtype = loaded.dtype
        # transformers computes in the dtype of kvfence's dense weights: bf16 where the CPU
        # has it, also where kvfence decodes in float32 (--dtype auto beside bf16 weights)
        peer_dtype = loaded.dense_weights_dtype
        _kvfence_runs(loaded, variant, work, warm, runs, errors, outputs, checks)
        del loaded, variant
    except ImportError as err:
        errors["kvfence"] = f"ImportError: {err}"
    _transformers_runs(peer_dtype, gguf, work, warm, runs, errors, outputs, checks)
    _llama_runs(gguf, work, warm, threads, quick, runs, errors, sweep, batched)
    return report(runs, errors, quick, threads, dtype, work, sizing, sweep, checks, peer_dtype,
                  batched)


def report(
    runs: list[Throughput],
    errors: dict[str, str],
    quick: bool,
    threads: int,
    dtype: torch.dtype,
    work: list[Work],
    sizing: dict[str, Any],
    sweep: dict[str, float] | None = None,
    checks: list[greedy_check.Agreement] | None = None,
    peer_dtype: torch.dtype | None = None,
    batched: list[BatchedRow] | None = None,
) -> dict[str, Any]:
    """``dtype``: kvfence's compute dtype; ``peer_dtype`` transformers' (default the same);
    ``sweep``: llama-server's output tok/s per setting; ``batched``: llama-batched-bench."""
    out = results_dir(quick)
    peer_dtype = peer_dtype or dtype
    checks = checks or []
    sweep = sweep or {}
    batched = batched or []
    groups = _by_system(runs)
    kv, grpc = _rates(runs, ENGINE), _rates(runs, "kvfence gRPC")
    targets: list[Target] = []
    ratios: dict[str, float] = {}
    if kv:
        # NOTE: judged strictly: kvfence's worst run against the peer's best run.
        for system, group in groups.items():
            ratios[system] = min(kv) / max(r.output_tok_s for r in group)
        for label, prefix in (
            ("llama-server best", "llama-server"),
            ("transformers best", "transformers"),
        ):
            peer = _best_system(runs, prefix)
            if peer is not None:
                targets.append(
                    Target(
                        f"offline output tok/s vs {label} ({peer}), worst run", ratios[peer], 2.0
                    )
                )
        one, two = _rates(runs, FAIR), _rates(runs, FAIR2)
        # What the budget costs: each round's timed run against the same round's untimed
        # run, and what sharing costs: each round's two-tenant run against the same round's
        # one-tenant run (neighbours in every round, so machine drift hits both alike).
        if one and len(one) == len(kv):
            targets.append(
                Target(
                    "served step budget (one tenant) / untimed engine output tok/s "
                    "(worst round)",
                    min(b / a for a, b in zip(kv, one, strict=True)),
                    0.97,
                )
            )
        if one and len(two) == len(one):
            targets.append(
                Target(
                    "served step budget, two tenants / one tenant output tok/s (worst round)",
                    min(b / a for a, b in zip(one, two, strict=True)),
                    0.95,
                )
            )
        http, server = _rates(runs, HTTP), _best_system(runs, "llama-server")
        if http and server is not None:
            targets.append(
                Target(
                    f"kvfence HTTP / {server} output tok/s, same client (worst run vs best run)",
                    min(http) / max(_rates(runs, server)),
                    1.0,
                )
            )
        fast = _rates(runs, VARIANT)
        if fast:
            targets.append(
                Target(
                    "batch invariance (default) / --batch-invariant off output tok/s "
                    "(medians; goal: invariance costs at most 10%)",
                    statistics.median(kv) / statistics.median(fast),
                    0.90,
                )
            )
        if grpc:
            targets.append(
                Target(
                    "gRPC / in-process output tok/s (worst gRPC run vs median)",
                    min(grpc) / statistics.median(kv),
                    0.95,
                )
            )
    check_target = greedy_check.target(checks)
    if check_target is not None:
        targets.append(check_target)
    systems: dict[str, dict[str, Any]] = {
        name: {
            "output_tok_s": _spread([r.output_tok_s for r in group]),
            "total_tok_s": _spread([r.total_tok_s for r in group]),
            "wall_s": _spread([r.wall_s for r in group]),
            "notes": group[0].notes,
        }
        for name, group in groups.items()
    }
    rows = [
        (
            name,
            _fmt(f["output_tok_s"]),
            _fmt(f["total_tok_s"]),
            _fmt(f["wall_s"]),
            f"{ratios[name]:.2f}" if name in ratios else "-",
            f["notes"],
        )
        for name, f in systems.items()
    ]
    plot = bar_plot(
        out,
        f"{SUITE}_throughput",
        list(systems),
        [f["output_tok_s"]["median"] for f in systems.values()],
        "Offline output throughput",
        "output tok/s",
    )
    md = "\n\n".join(
        [
            f"# Offline throughput{' (quick)' if quick else ''}",
            f"{len(work)} requests, {sum(len(w.prompt_ids) for w in work)} prompt and "
            f"{sum(w.max_tokens for w in work)} output tokens; greedy, ignore_eos; {threads} threads; "
            f"dtype {str(dtype).removeprefix('torch.')} (kvfence), "
            f"{str(peer_dtype).removeprefix('torch.')} (transformers), Q4_1 (llama.cpp). "
            "kvfence HTTP and llama-server are driven by the same client (the openai SDK, "
            "bench/http_client.py) in the suite's process. "
            f"Median [min–max] of {REPEATS} runs per system.",
            md_table(
                (
                    "system",
                    "output tok/s",
                    "total tok/s",
                    "wall s",
                    "kvfence worst / system best",
                    "notes",
                ),
                rows,
            ),
            targets_table(targets),
            *([checks_table(checks)] if checks else []),
            *([sweep_table(sweep, len(work))] if sweep else []),
            *([batched_table(batched, min(kv) if kv else None)] if batched else []),
            f"![throughput]({plot})",
            *(f"**error** {name}: {msg}" for name, msg in errors.items()),
        ]
    )
    data = {
        "suite": SUITE,
        "quick": quick,
        "machine": machine_info(threads),
        "dtype": str(dtype),
        "transformers_dtype": str(peer_dtype),
        "kvfence_sizing": sizing,
        "runs": [r.as_dict() for r in runs],
        "systems": systems,
        "ratios_kvfence_over": ratios,
        "llama_server_sweep": sweep,
        "llama_batched_bench": [b.as_dict() for b in batched],
        "greedy_check": [a.as_dict() for a in checks],
        "targets": targets,
        "errors": errors,
    }
    write_suite(out, SUITE, data, md)
    return data


def sweep_table(sweep: dict[str, float], n: int) -> str:
    """The llama-server sweep, fastest first; the first row is the setting compared against."""
    ranked = sorted(sweep.items(), key=lambda kv: -kv[1])
    return "\n\n".join(
        [
            f"llama-server sweep (one run each on the first {max(1, n // 4)} requests: slots "
            "at -ub 512, then other -ub at the best slot count); the fastest setting is the "
            "one timed in full and compared against:",
            md_table(
                ("llama-server setting", "output tok/s", "chosen"),
                [(c, v, "best" if i == 0 else "") for i, (c, v) in enumerate(ranked)],
            ),
        ]
    )


def batched_table(rows: list[BatchedRow], kvfence_worst: float | None) -> str:
    """llama-batched-bench per parallel count, with kvfence's worst engine run against each."""
    return "\n\n".join(
        [
            f"llama-batched-bench (raw batched prefill then decode, no server or scheduler; "
            f"{rows[0].prompt}-token prompts, {rows[0].output} output tokens, the work's means):",
            md_table(
                ("parallel", "decode tok/s (S_TG)", "output tok/s incl. prefill",
                 "kvfence engine worst / this"),
                [(r.parallel, r.decode_tok_s, r.output_tok_s,
                  f"{kvfence_worst / r.output_tok_s:.2f}" if kvfence_worst else "-")
                 for r in rows],
            ),
        ]
    )


def checks_table(checks: list[greedy_check.Agreement]) -> str:
    """Each system's batched tokens against its own one-request greedy run."""
    return "\n\n".join(
        [
            f"Greedy check: {checks[0].sampled} sampled requests per system rerun one at a time on "
            "the same system; tokens equal before the first difference, per request:",
            md_table(greedy_check.TABLE_HEAD, greedy_check.table_rows(checks)),
        ]
    )
