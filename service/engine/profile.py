"""Step overhead: one full engine decode step versus the raw batched model forward.

``measure_step_overhead(loaded, batch=8, context=256)`` fills a fresh thread-free core with
``batch`` greedy sequences of ``context`` prompt tokens, lets them reach steady decoding, then
times whole ``EngineCore.step()`` calls (schedule, fence, inputs, forward, sample, detokenize,
stream) and, inside the same steps, the bare model forward (``StepStats.forward_s``); both
are medians over ``repeats``.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcache import CacheConfig
from service.engine.factory import build_core
from service.engine.tuning import SchedulerTuning
from service.engine.types import EngineConfig, Request, SamplingParams, StoppingParams
from service.model.loader import LoadedModel


def measure_step_overhead(
    loaded: LoadedModel, batch: int, context: int, *, repeats: int = 5
) -> tuple[float, float]:
    """Return ``(engine_step_s, raw_forward_s)`` for a decode step of ``batch`` sequences."""
    if batch < 1 or context < 1 or repeats < 1:
        raise ValueError("batch, context and repeats must be >= 1")
    config = EngineConfig(
        max_num_seqs=batch,
        # every prompt in one step
        tuning=SchedulerTuning(max_num_batched_tokens=batch * (context + 1)),
        max_model_len=context + 2 * repeats + 8,
        warmup=False,
    )
    cache_config = CacheConfig(page_size=16, default_ttl_s=0.0)
    pages = batch * (-(-config.max_model_len // cache_config.page_size) + 1)
    core = build_core(loaded, config, cache_config, kv_pages=pages, sampler_seed=0)
    vocab = core.tokens.vocab_size
    for i in range(batch):
        core.add(
            Request(
                request_id=f"profile-{i}",
                tenant="profile",
                prompt_ids=tuple((i * 131 + j) % vocab for j in range(context)),
                sampling=SamplingParams(temperature=0.0),
                stopping=StoppingParams(max_tokens=2 * repeats + 6, ignore_eos=True),
            ),
            lambda event: None,
        )
    engine_times: list[float] = []
    raw_times: list[float] = []
    with torch.inference_mode():
        # Prefill, then two decode steps so every shape is warm.
        while True:  # until a step carries exactly one token of every sequence
            stats = core.step()
            if stats.num_seqs == batch == stats.num_tokens and not core.counters().num_waiting:
                break
        core.step()
        for _ in range(repeats):
            start = time.perf_counter()
            stats = core.step()
            engine_times.append(time.perf_counter() - start)
            assert stats.num_seqs == batch and stats.num_tokens == batch
            raw_times.append(stats.forward_s)
    core.finish_all("abort")
    return statistics.median(engine_times), statistics.median(raw_times)
