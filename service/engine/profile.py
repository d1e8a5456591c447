"""Step overhead: one full engine decode step versus the raw batched model forward.

``measure_step_overhead(loaded, batch=8, context=256)`` fills a fresh engine with ``batch``
greedy sequences of ``context`` prompt tokens, lets them reach steady decoding, then times
``EngineCore.step()`` (schedule, fence, inputs, forward, sample, detokenize, stream) and the
bare ``model(...)`` call on the same batch, alternately; both are medians over ``repeats``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvcache import CacheConfig
from service.engine.factory import build_engine
from service.engine.runner import build_inputs, fence
from service.engine.scheduler import ScheduledSeq
from service.engine.types import EngineConfig, Request, SamplingParams, StoppingParams
from service.model.loader import LoadedModel


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_step_overhead(
    loaded: LoadedModel, batch: int, context: int, *, repeats: int = 5
) -> tuple[float, float]:
    """Return ``(engine_step_s, raw_forward_s)`` for a decode step of ``batch`` sequences."""
    if batch < 1 or context < 1 or repeats < 1:
        raise ValueError("batch, context and repeats must be >= 1")
    config = EngineConfig(
        max_num_seqs=batch,
        max_num_batched_tokens=max(batch, 512),
        max_model_len=context + 2 * repeats + 8,
        warmup=False,
    )
    cache_config = CacheConfig(page_size=16, default_ttl_s=0.0)
    pages = batch * (-(-config.max_model_len // cache_config.page_size) + 1)
    engine = build_engine(loaded, config, cache_config, kv_pages=pages, sampler_seed=0)
    core = engine.core
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
    with torch.inference_mode():
        while any(s.num_output < 2 for s in core.scheduler.running) or core.num_waiting():
            core.step()
        engine_times: list[float] = []
        raw_times: list[float] = []
        # NOTE: alternate the two measurements so machine load drifts hit both alike.
        for _ in range(repeats):
            engine_times.append(_time(core.step))
            entries = [ScheduledSeq(s, 1) for s in core.scheduler.running]
            for e in entries:
                core.cache.allocate_slots(e.seq.seq_id, 1)
            attn = fence(core.cache, entries).attn
            assert attn is not None
            inputs = build_inputs(entries, core.runner.device)
            raw_times.append(_time(lambda: core.runner.forward(inputs, attn)))  # noqa: B023
    core.finish_all("abort")
    return statistics.median(engine_times), statistics.median(raw_times)
