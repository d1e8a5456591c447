"""Suite: what per-tenant LoRA adapters cost against the base model alone.

Two figures, each a ratio judged on its worst run (RUNS interleaved runs after a warm-up):

- 16 streams over 4 adapters (4 streams each, every step mixing the adapters' rows) against
  16 streams on the base: total generated tokens per second, target >= 0.7x;
- 1 stream on an adapter against 1 stream on the base: decode tokens per second over
  SINGLES requests each, run one after another with the systems taking turns (request i on
  every system before request i + 1 on any), target >= 0.8x.

The adapters are random PEFT LoRA directories (rank 16, all seven projections) written for
the default model, saved in bfloat16 (as a model trained in bfloat16 saves them; held in
bfloat16 and widened exactly where read). The same adapters saved in float32 (held in
float32, twice the bytes a token reads) are measured beside them and reported, without a
target. The engine runs in process (``--weights auto``), each request greedy with
ignore_eos and the prefix cache bypassed, so every system computes the same tokens' work.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.common import (
    RUNS,
    Target,
    Work,
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
from bench.kvfence_runner import GREEDY, Sizing, drive, started_engine
from bench.traces import RequestTrace
from service.engine.engine import Engine
from service.engine.types import Delta, Finished, Request, StoppingParams
from service.model.lora import TARGETS, LoraAdapter, load_lora
from service.model.model_config import ModelConfig

SUITE = "lora"
RANK = 16
ADAPTERS = 4
STREAMS = 16
# one stream's figure of a run: this many requests a system, the systems taking turns request
# by request (one request's ~0.5 s swung 0.64-0.85x with the host's hiccups in one run, and
# each system's requests run back to back put seconds of the host's drift between a system
# and the base it is judged against)
SINGLES = 8
PROMPT_TOKENS = 32


def write_random_adapter(
    directory: Path, config: ModelConfig, rank: int, seed: int, dtype: torch.dtype = torch.float32
) -> Path:
    """A PEFT LoRA directory with random A and B for every target projection, saved in
    ``dtype``."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGETS:
            out, inp = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=gen) * 0.02).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=gen) * 0.02).to(dtype)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
           "use_rslora": False, "use_dora": False, "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    return directory


async def _generate(
    engine: Engine, work: Sequence[Work], adapters: Sequence[LoraAdapter | None]
) -> tuple[float, list[RequestTrace]]:
    """Every request at once; request i on adapters[i % len(adapters)]."""

    async def one(i: int) -> RequestTrace:
        w = work[i]
        trace = RequestTrace("bench", len(w.prompt_ids), time.perf_counter())
        request = Request(
            request_id=uuid.uuid4().hex, tenant="bench", prompt_ids=w.prompt_ids,
            sampling=GREEDY, stopping=StoppingParams(max_tokens=w.max_tokens, ignore_eos=True),
            bypass_prefix_cache=True, adapter=adapters[i % len(adapters)],
        )
        async for event in await engine.submit(request):
            if isinstance(event, Delta):
                trace.on_chunk(time.perf_counter(), len(event.token_ids), event.token_ids)
            elif isinstance(event, Finished):
                trace.end = time.perf_counter()
                trace.finish_reason = event.reason
        return trace

    return await drive(len(work), one)


def _tokens_per_s(wall: float, traces: Sequence[RequestTrace], work: Sequence[Work]) -> float:
    for t, w in zip(traces, work, strict=True):
        if t.output_tokens != w.max_tokens:
            raise RuntimeError(f"{t.output_tokens}/{w.max_tokens} tokens streamed")
    return sum(w.max_tokens for w in work) / wall


def _decode_tok_s(traces: Sequence[RequestTrace]) -> float:
    """Decode tokens per second over streams run one after another: their decoded tokens
    after the first over their decode time."""
    tokens = sum(t.output_tokens - 1 for t in traces)
    seconds = sum(t.chunk_times[-1] - t.chunk_times[0] for t in traces if t.chunk_times)
    if tokens < 1 or seconds <= 0:
        raise RuntimeError("the single streams produced fewer than 2 tokens each")
    return tokens / seconds


_System = tuple[str, list[LoraAdapter | None]]  # a system's name and its rows' adapters


async def _measure(quick: bool) -> dict[str, list[float]]:
    from service.model import load_model

    path = default_model_file()
    vocab = gguf_vocab_size(path)
    loaded = load_model(str(path), weights="auto", progress=False)
    cfg = loaded.model.config
    held = {"adapters": torch.bfloat16, "float32 adapters": torch.float32}
    with tempfile.TemporaryDirectory() as tmp:
        sets = {
            name: [
                load_lora(f"a{k}", write_random_adapter(Path(tmp) / f"{name}{k}", cfg, RANK, k, dtype),
                          cfg, loaded.model.dtype, max_rank=64)
                for k in range(ADAPTERS)
            ]
            for name, dtype in held.items()
        }
    for name, dtype in held.items():
        if any(g.a.dtype != dtype for a in sets[name] for g in a.groups.values()):
            raise RuntimeError(f"{name}: not held in {dtype}")
    tokens = 16 if quick else 128
    sizing = Sizing(max_num_seqs=32, max_model_len=512, kv_bytes=256 << 20)
    figures: dict[str, list[float]] = {}
    with started_engine(loaded, sizing) as engine:
        for r in range(RUNS + 1):  # run 0 warms up
            many = random_work(200 + r, STREAMS, (PROMPT_TOKENS,) * 2, (tokens,) * 2, vocab)
            ones = random_work(300 + r, SINGLES, (PROMPT_TOKENS,) * 2, (tokens,) * 2, vocab)
            order: list[_System] = [("base", [None])]
            order += [(name, list(adapters)) for name, adapters in sets.items()]
            for name, chosen in _turn(order, r):
                wall, traces = await _generate(engine, many, chosen)
                many_tok_s = _tokens_per_s(wall, traces, many)
                if r > 0:
                    figures.setdefault(f"{STREAMS} streams, {name}", []).append(many_tok_s)
                print(f"[{SUITE}] run {r} {name}: {STREAMS} streams {many_tok_s:.1f} tok/s",
                      flush=True)
            singles: dict[str, list[RequestTrace]] = {name: [] for name, _ in order}
            for i, w in enumerate(ones):
                for name, chosen in _turn(order, r + i):
                    singles[name].append((await _generate(engine, [w], chosen[:1]))[1][0])
            for name, traces in singles.items():
                single_tok_s = _decode_tok_s(traces)
                if r > 0:
                    figures.setdefault(f"1 stream, {name}", []).append(single_tok_s)
                print(f"[{SUITE}] run {r} {name}: 1 stream {single_tok_s:.1f} tok/s", flush=True)
    return figures


def _turn(order: list[_System], shift: int) -> list[_System]:
    """The systems in turn, starting ``shift`` places along (no system always first)."""
    at = shift % len(order)
    return order[at:] + order[:at]


def _ratios(figures: dict[str, list[float]], load: str, system: str) -> list[float]:
    """Run by run, ``system``'s tokens/s under ``load`` over the base's."""
    return [a / b for a, b in zip(figures[f"{load}, {system}"], figures[f"{load}, base"],
                                  strict=True)]


def run(quick: bool = False) -> dict[str, Any]:
    threads = bench_threads()
    set_torch_threads(threads)
    figures = asyncio.run(_measure(quick))
    many, single = f"{STREAMS} streams", "1 stream"
    targets = [
        Target(f"{STREAMS} streams over {ADAPTERS} adapters / base-only throughput (worst run)",
               min(_ratios(figures, many, "adapters")), 0.7),
        Target("1 stream with an adapter / base decode (worst run)",
               min(_ratios(figures, single, "adapters")), 0.8),
    ]
    for name in (many, single):
        print(f"[{SUITE}] {name}, float32 adapters / base: "
              + ", ".join(f"{v:.3f}" for v in _ratios(figures, name, "float32 adapters")),
              flush=True)
    rows = [(name, " / ".join(f"{v:.1f}" for v in runs)) for name, runs in figures.items()]
    md = "\n\n".join([
        f"# LoRA adapters{' (quick)' if quick else ''}",
        f"Rank-{RANK} random adapters on all seven projections of the default model, saved in "
        f"bfloat16 (the targets) and in float32, "
        f"{PROMPT_TOKENS}-token prompts, greedy, prefix cache bypassed; 1 stream: {SINGLES} "
        f"requests a system, one after another, the systems taking turns; {threads} threads; "
        f"{RUNS} interleaved runs after a warm-up. Figures: tokens/s per run.",
        md_table(("system", "tok/s per run"), rows),
        targets_table(targets),
    ])
    data = {"suite": SUITE, "quick": quick, "machine": machine_info(threads),
            "systems": figures, "targets": targets}
    write_suite(results_dir(quick), SUITE, data, md)
    return data
