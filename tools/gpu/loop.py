"""Offline greedy generation through kvfence's own path: KVCacheManager (fence, metadata,
paged KV) and the engine's ModelRunner (decode CUDA graphs through its hook, when given),
without the scheduler: every sequence runs every step, EOS is ignored."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache import KVCacheManager, StepAttention, StepEntry, UnknownSequence
from service.engine.cuda_graphs import DecodeGraphs
from service.engine.runner import BatchInputs, ModelRunner
from service.model.decoder import DecoderModel

TENANT = "gpu-check"


@dataclass(frozen=True, slots=True)
class Generation:
    tokens: list[list[int]]  # new tokens per prompt
    prefill_s: float
    decode_s: float  # the new_tokens - 1 decode steps
    graph_replays: int
    logits: torch.Tensor | None  # [new_tokens, batch, vocab] float32 on the host, if kept


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill(
    runner: ModelRunner,
    cache: KVCacheManager,
    ids: list[str],
    prompts: Sequence[Sequence[int]],
) -> torch.Tensor:
    device = runner.device
    tokens, positions, last = [], [], []
    for p in prompts:
        tokens.extend(p)
        positions.extend(range(len(p)))
        last.append(len(tokens) - 1)
    attn = _fenced(cache, [StepEntry(s, 0, len(p)) for s, p in zip(ids, prompts, strict=True)])
    inputs = BatchInputs(
        torch.tensor(tokens, device=device),
        torch.tensor(positions, device=device),
        torch.tensor(last, device=device),
    )
    return runner.forward(inputs, attn)


def _grow(cache: KVCacheManager, seq_id: str, num_tokens: int) -> None:
    fit = cache.allocate_slots(seq_id, num_tokens)
    if not fit.ok:
        raise RuntimeError(f"the batch does not fit the KV pool ({fit.reason})")


def _fenced(cache: KVCacheManager, entries: list[StepEntry]) -> StepAttention:
    plan = cache.begin_step(entries)
    if plan.refused or plan.attn is None:
        raise RuntimeError(f"fence refused {plan.refused[0][1] if plan.refused else 'all'}")
    return plan.attn


def generate(
    model: DecoderModel,
    cache: KVCacheManager,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    graphs: DecodeGraphs | None = None,
    keep_logits: bool = False,
) -> Generation:
    """Greedy ``new_tokens`` for every prompt in one batch; frees every page at the end.
    ``keep_logits`` keeps every step's logits (small models only)."""
    device = model.device
    runner = ModelRunner(model, device, graphs)  # the engine's runner, graph hook included
    ids = [f"gen-{i}" for i in range(len(prompts))]
    replays = graphs.replays if graphs is not None else 0
    try:
        for s, p in zip(ids, prompts, strict=True):
            cache.open(s, TENANT, list(p), use_prefix_cache=False)
            _grow(cache, s, len(p))
        _sync(device)
        start = time.perf_counter()
        logits = _prefill(runner, cache, ids, prompts)
        kept = [logits.cpu()] if keep_logits else []
        last = [int(t) for t in logits.argmax(-1).tolist()]
        out = [[t] for t in last]
        lens = [len(p) for p in prompts]
        seqs = [list(p) for p in prompts]  # each sequence's tokens (the caller owns them)
        for s, seq, n, t in zip(ids, seqs, lens, last, strict=True):
            cache.commit(s, seq, n)
            seq.append(t)
        _sync(device)
        prefill_s = time.perf_counter() - start
        rows = torch.arange(len(prompts), device=device)
        for _ in range(new_tokens - 1):
            for s, n in zip(ids, lens, strict=True):
                _grow(cache, s, n + 1)
            attn = _fenced(cache, [StepEntry(s, n, 1) for s, n in zip(ids, lens, strict=True)])
            inputs = BatchInputs(
                torch.tensor(last, device=device), torch.tensor(lens, device=device), rows
            )
            logits = runner.forward(inputs, attn)
            last = [int(t) for t in logits.argmax(-1).tolist()]  # the engine syncs here too
            if keep_logits:
                kept.append(logits.cpu())
            lens = [n + 1 for n in lens]
            for s, seq, n, t, o in zip(ids, seqs, lens, last, out, strict=True):
                cache.commit(s, seq, n)
                seq.append(t)
                o.append(t)
        _sync(device)
        decode_s = time.perf_counter() - start - prefill_s
    finally:
        for s in ids:
            with contextlib.suppress(UnknownSequence):
                cache.free(s)
    used = (graphs.replays - replays) if graphs is not None else 0
    return Generation(out, prefill_s, decode_s, used, torch.stack(kept) if kept else None)
