"""Suite: every kernel tier against llama.cpp built for the same instruction sets.

For each tier this CPU has (bench.llamacpp_flags.tiers: the native build, and where the CPU
has more than AVX2 the AVX2 build, ``KVFENCE_KERNEL_ISA=avx2``) and each model (the default
SmolLM2-135M Q4_1 and gemma-3-270m Q4_K_M, the same GGUF for both systems):

- **single stream**: ``REPS`` greedy requests over gRPC, one at a time, each a 32-token
  random prompt then 128 tokens (ignore_eos); the run's decode tok/s is their median. The
  peer is ``llama-bench`` tg128 (``-r REPS``) of the tier's llama.cpp build (``make peers``).
- **TTFT(512)**: ``REPS`` requests of 512 random ids for one token over gRPC, one at a time,
  prefix cache bypassed; their median, against 512 / ``llama-bench`` pp512 of the same run.
- **offline**: the offline suite's 64 requests over gRPC, all at once, against the tier's
  ``llama-server``, its slots and physical batch swept once per tier and model on a quarter
  of the work (bench.llama_server.sweep) and its best setting timed in full each run.
- **isolation tax**: the same 64 requests sent by two tenants (alternate requests) to the
  same server, against the one tenant's run (the two back to back after an unmeasured run of
  the same work, one first on even runs, two on odd ones): two tenants' output tok/s over one
  tenant's.
- **roofline**: the machine's memory read bandwidth (:func:`read_bandwidth`, measured at the
  start of the suite) over the file's weight bytes (the model size llama-bench reports: a
  decode token reads every weight once, the tied embedding as the head), the same for both
  systems; each single-stream figure as a fraction. kvfence's own packed bytes are recorded
  beside it (its K-quant and Q5_0 layouts hold more bytes than the file).

Runs are interleaved (run r of every tier and model, then run r + 1), and within a run each
pair goes back to back, kvfence first on even runs and llama.cpp first on odd ones. Each
kvfence measurement is a process of its own with the tier's ``KVFENCE_KERNEL_ISA`` (a
process builds its kernels once, for one tier), the server in it and the client in another
(bench.grpc_client). Targets are judged on the worst run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import llama_server
from bench.common import (
    RUNS,
    Spread,
    Work,
    bench_threads,
    default_model_file,
    fmt_spread,
    gguf_vocab_size,
    machine_info,
    md_table,
    random_work,
    results_dir,
    spread,
    targets_table,
    throughput,
    worst_target,
    write_suite,
)
from bench.llamacpp_flags import this_cpu, tiers
from bench.offline import workload
from bench.offline_llama import run_server

SUITE = "tiers"
PROMPT, DECODE, LONG = 32, 128, 512
REPS = 5
TENANT, OTHER = "bench", "other"
SECOND = "gemma-3-270m"  # the second pullable model (service.model.catalog)
# What a process of each tier runs with: kvfence's kernels built for the tier, and torch's
# own dispatch (ATen, oneDNN, MKL) held to the same instruction sets, so the AVX2 tier
# computes as it would on an AVX2-only CPU (float32 dense weights: loader.tier_has_bf16).
TIER_ENV = {
    "native": {"KVFENCE_KERNEL_ISA": "native"},
    "avx2": {"KVFENCE_KERNEL_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
             "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
# The goals per tier and model, judged on the worst run.
DECODE_GOAL, TTFT_GOAL, OFFLINE_GOAL, ROOFLINE_GOAL, TAX_GOAL = 1.1, 1.0, 2.0, 0.6, 0.95


@dataclass(frozen=True, slots=True)
class Case:
    """One tier and model: the GGUF and the work every run sends."""

    tier: str
    model: str
    path: Path

    @property
    def label(self) -> str:
        return f"{self.tier}, {self.model}"


def read_bandwidth(threads: int, gib: float = 1.0, passes: int = 5) -> float:
    """Bytes a second this machine reads from memory: the best of ``passes`` sums of a
    ``gib`` GiB float32 tensor, too large for any cache, over ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()  # pages in
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def llama_bench(path: Path, tier: str, threads: int, reps: int, tokens: int) -> dict[str, Any]:
    """``llama-bench`` pp512 and tg``tokens`` of ``tier``'s build: their tok/s and the model
    size it reports (the bytes its weights take)."""
    args = [str(llama_server.binary(llama_server.LLAMA_BENCH, tier)), "-m", str(path),
            "-t", str(threads), "-p", str(LONG), "-n", str(tokens), "-r", str(reps), "-o", "json"]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"{llama_server.LLAMA_BENCH} exited with {done.returncode}: {tail}")
    tests = json.loads(done.stdout)
    pp = next(t for t in tests if t["n_prompt"] == LONG and t["n_gen"] == 0)
    tg = next(t for t in tests if t["n_prompt"] == 0 and t["n_gen"] == tokens)
    return {"pp_tok_s": float(pp["avg_ts"]), "tg_tok_s": float(tg["avg_ts"]),
            "model_bytes": int(tg["model_size"])}


def _job(path: Path, works: dict[str, list[Work]], two_first: bool) -> dict[str, Any]:
    return {"path": str(path), "two_first": two_first,
            **{k: [{"prompt_ids": list(w.prompt_ids), "max_tokens": w.max_tokens} for w in ws]
               for k, ws in works.items()}}


def kvfence_run(case: Case, works: dict[str, list[Work]], two_first: bool = False
                ) -> dict[str, Any]:
    """One run of kvfence on ``case`` in a process of its own built for the case's tier
    (``two_first``: the offline work by two tenants before the one tenant's run)."""
    env = {**os.environ, **TIER_ENV[case.tier]}
    done = subprocess.run(
        [sys.executable, "-m", "bench.tiers", "--child"],
        input=json.dumps(_job(case.path, works, two_first)), capture_output=True, text=True,
        env=env,
        cwd=str(Path(__file__).resolve().parents[1]), check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kvfence ({case.label}) failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


async def _child(job: dict[str, Any]) -> dict[str, Any]:
    """The measurement inside the tier's process: a server on 127.0.0.1, its client
    elsewhere."""
    from bench.kvfence_runner import check_complete, grpc_server, load_kvfence, run_grpc_elsewhere

    def works(key: str) -> list[Work]:
        return [Work(tuple(w["prompt_ids"]), int(w["max_tokens"])) for w in job[key]]

    loaded = load_kvfence(job["path"])
    packed = loaded.model.packed
    every = [] if packed is None else [*packed.qkv, *packed.o, *packed.gate_up, *packed.down]
    # the bytes a decode token reads, where every projection and the head are packed
    weight_bytes = packed.nbytes if packed and all(every) and packed.lm_head else None
    async with grpc_server(loaded, (TENANT, OTHER)) as (target, keys, _):

        async def go(ws: list[Work], one_at_a_time: bool, tenants: tuple[str, ...] = (TENANT,)
                     ) -> tuple[float, list[Any]]:
            wall, traces = await run_grpc_elsewhere(
                target, keys, ws, tenants, bypass_prefix_cache=True,
                max_concurrency=1 if one_at_a_time else None)
            check_complete(ws, traces)
            return wall, traces

        await go(works("warm"), True)
        _, decode = await go(works("decode"), True)
        _, ttft = await go(works("ttft"), True)
        # Measured: a process's first offline run was up to 10% slower than its second,
        # whichever number of tenants ran first; so one unmeasured run goes before the pair.
        await go(works("offline"), False)
        walls: dict[int, float] = {}
        for n in (2, 1) if job["two_first"] else (1, 2):
            walls[n], _ = await go(works("offline"), False, (TENANT, OTHER)[:n])
    offline, offline_two = (throughput("kvfence gRPC", works("offline"), walls[n]).output_tok_s
                            for n in (1, 2))
    return {
        "decode_tok_s": sorted(1.0 / t.tpot for t in decode)[len(decode) // 2],
        "ttft_s": sorted(t.ttft for t in ttft)[len(ttft) // 2],
        "offline_tok_s": offline,
        "offline_two_tenants_tok_s": offline_two,
        "weight_bytes": weight_bytes,
        "stack": loaded.model.stack is not None,
        "dense_dtype": str(loaded.dense_dtype or loaded.dtype),
    }


def _cases() -> list[Case]:
    from service.model.catalog import ensure_model

    models = (("SmolLM2-135M Q4_1", default_model_file()), (f"{SECOND} Q4_K_M", ensure_model(SECOND)))
    return [Case(t, m, p) for t in tiers(this_cpu()) for m, p in models]


def _ratio_rows(name: str, a: Sequence[float], b: Sequence[float]) -> Spread:
    if len(a) != len(b):
        raise RuntimeError(f"{name}: {len(a)} kvfence runs, {len(b)} llama.cpp runs")
    return spread(x / y for x, y in zip(a, b, strict=True))


def run(quick: bool = False) -> dict[str, Any]:
    threads = bench_threads()
    out = results_dir(quick)
    bandwidth = read_bandwidth(threads, 0.25 if quick else 1.0)
    print(f"[{SUITE}] memory read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    cases = _cases()
    tokens, reps = (16, 2) if quick else (DECODE, REPS)
    runs = 1 if quick else RUNS
    plans: dict[str, list[dict[str, list[Work]]]] = {}
    best: dict[str, llama_server.ServerConfig | None] = {}
    sweeps: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "llama-server.log"
        for i, case in enumerate(cases):
            vocab = gguf_vocab_size(case.path)
            offline, warm = workload(quick, vocab)
            plans[case.label] = [
                {"warm": [*random_work(500 + i, 1, (LONG,) * 2, (4,) * 2, vocab), *warm[:2]],
                 "decode": random_work(100 + 10 * r + i, reps, (PROMPT,) * 2, (tokens,) * 2,
                                       vocab),
                 "ttft": random_work(200 + 10 * r + i, reps, (LONG,) * 2, (1,) * 2, vocab),
                 "offline": offline, "offline_warm": warm}
                for r in range(runs)
            ]
            part = offline[: max(1, len(offline) // 4)]

            def measure(config: llama_server.ServerConfig, c: Case = case,
                        p: list[Work] = part, w: list[Work] = warm) -> float:
                return run_server(config, c.path, p, w, log).output_tok_s

            print(f"[{SUITE}] sweeping llama-server ({case.label}) ...", flush=True)
            best[case.label], sweeps[case.label] = llama_server.sweep(
                llama_server.QUICK_SLOTS if quick else llama_server.SLOTS,
                () if quick else llama_server.UBATCHES, threads, measure, errors, case.tier,
            )
        got: dict[str, dict[str, list[Any]]] = {c.label: {"kvfence": [], "llama": []}
                                                 for c in cases}
        for r in range(runs):
            for case in cases:
                plan = plans[case.label][r]

                def ours(c: Case = case, p: dict[str, list[Work]] = plan,
                         odd: bool = r % 2 == 1) -> dict[str, Any]:
                    return kvfence_run(c, p, two_first=odd)

                def theirs(c: Case = case, p: dict[str, list[Work]] = plan) -> dict[str, Any]:
                    figures = llama_bench(c.path, c.tier, threads, reps, tokens)
                    config = best[c.label]
                    figures["offline_tok_s"] = None if config is None else run_server(
                        config, c.path, p["offline"], p["offline_warm"], log).output_tok_s
                    return figures

                order = [("kvfence", ours), ("llama", theirs)]
                for who, fn in order if r % 2 == 0 else order[::-1]:
                    print(f"[{SUITE}] {case.label}: {who} (run {r + 1}/{runs}) ...", flush=True)
                    got[case.label][who].append(fn())
                    print(f"[{SUITE}]   {got[case.label][who][-1]}", flush=True)
    return report(out, quick, threads, bandwidth, cases, got, sweeps, best, errors)


def report(
    out: Path,
    quick: bool,
    threads: int,
    bandwidth: float,
    cases: Sequence[Case],
    got: dict[str, dict[str, list[Any]]],
    sweeps: dict[str, dict[str, float]],
    best: dict[str, llama_server.ServerConfig | None],
    errors: dict[str, str],
) -> dict[str, Any]:
    rows, targets, figures = [], [], {}
    for case in cases:
        ours, theirs = got[case.label]["kvfence"], got[case.label]["llama"]
        decode = [r["decode_tok_s"] for r in ours]
        peer_decode = [r["tg_tok_s"] for r in theirs]
        ttft = [r["ttft_s"] for r in ours]
        peer_ttft = [LONG / r["pp_tok_s"] for r in theirs]
        offline = [r["offline_tok_s"] for r in ours]
        peer_offline = [r["offline_tok_s"] for r in theirs]
        d_ratio = _ratio_rows(case.label, decode, peer_decode)
        t_ratio = _ratio_rows(case.label, ttft, peer_ttft)
        tax = _ratio_rows(case.label, [r["offline_two_tenants_tok_s"] for r in ours], offline)
        fig: dict[str, Any] = {
            "decode_tok_s": spread(decode), "llama_tg_tok_s": spread(peer_decode),
            "decode_ratio": d_ratio, "ttft_s": spread(ttft), "llama_pp512_s": spread(peer_ttft),
            "ttft_ratio": t_ratio, "offline_tok_s": spread(offline), "isolation_tax": tax,
            "native_stack": all(r["stack"] for r in ours), "dense_dtype": ours[0]["dense_dtype"],
        }
        name = case.label
        targets += [worst_target(f"{name}: decode / llama.cpp tg{DECODE}", d_ratio, DECODE_GOAL),
                    worst_target(f"{name}: TTFT(512) / llama.cpp pp512", t_ratio, TTFT_GOAL,
                                 higher_is_better=False),
                    worst_target(f"{name}: offline 64, two tenants / one tenant", tax, TAX_GOAL)]
        o_cell = "n/a"
        if all(p is not None for p in peer_offline):
            o_ratio = _ratio_rows(name, offline, peer_offline)
            chosen = best[name]
            fig |= {"llama_server_tok_s": spread(peer_offline), "offline_ratio": o_ratio,
                    "llama_server_best": chosen.label if chosen else None}
            targets.append(worst_target(f"{name}: offline 64 / llama-server", o_ratio,
                                        OFFLINE_GOAL))
            o_cell = f"{fmt_spread(spread(offline).as_dict())} / " \
                     f"{fmt_spread(spread(peer_offline).as_dict())} = {o_ratio}"
        model_bytes = theirs[0]["model_bytes"]
        roof = spread(v * model_bytes / bandwidth for v in decode)
        peer_roof = spread(v * model_bytes / bandwidth for v in peer_decode)
        fig |= {"roofline": roof, "llama_roofline": peer_roof, "model_bytes": model_bytes,
                "kvfence_weight_bytes": ours[0]["weight_bytes"]}
        roof_cell = f"{roof} / {peer_roof}"
        if case.tier == "native":
            targets.append(worst_target(f"{name}: decode / memory roofline", roof,
                                        ROOFLINE_GOAL))
        figures[name] = fig
        rows.append((name, f"{spread(decode)} / {spread(peer_decode)} = {d_ratio}",
                     f"{spread(ttft)} / {spread(peer_ttft)} = {t_ratio}", o_cell, str(tax),
                     roof_cell))
    data = {
        "suite": SUITE, "quick": quick, "machine": machine_info(threads),
        "memory_read_bandwidth_bytes_s": bandwidth, "figures": figures,
        "llama_server_sweeps": sweeps, "targets": [t.as_dict() for t in targets],
        "errors": errors,
    }
    markdown = "\n\n".join([
        f"# Kernel tiers against llama.cpp built for each (memory read {bandwidth / 1e9:.1f} "
        "GB/s)",
        md_table(("tier, model", "decode tok/s: kvfence gRPC / llama-bench tg "
                  f"{DECODE} = ratio", "TTFT(512) s: kvfence gRPC / llama.cpp pp512 = ratio",
                  "offline output tok/s: kvfence gRPC / best llama-server = ratio",
                  "offline, two tenants / one", "decode / roofline: kvfence / llama.cpp"),
                 rows),
        targets_table(targets),
        *([md_table(("system", "error"), list(errors.items()))] if errors else []),
    ])
    write_suite(out, SUITE, data, markdown)
    print(markdown, flush=True)
    return data


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tiers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny smoke-sized run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(_child(json.loads(sys.stdin.read())))))
        return 0
    run(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
