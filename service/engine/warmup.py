"""Warm-up: run the shapes serving will use before the first real request arrives.

One long prefill chunk and a few decode batch sizes, through the full step (scheduler,
kvcache, forward, sampler with every option), under a reserved internal tenant that no
client can name. Afterwards the warm-up tenant's cached pages are purged, so the pool is
back at its baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from service.engine.core import EngineCore
from service.engine.types import (
    WARMUP_TENANT,
    EngineEvent,
    Request,
    SamplingParams,
    StoppingParams,
)

log = structlog.get_logger(__name__)

_SAMPLING = SamplingParams(
    temperature=0.8,
    top_k=20,
    top_p=0.9,
    min_p=0.01,
    repetition_penalty=1.1,
    presence_penalty=0.1,
    frequency_penalty=0.1,
    seed=0,
)


def _discard(event: EngineEvent) -> None:
    del event


def _run(core: EngineCore, requests: list[Request]) -> None:
    for request in requests:
        core.add(request, _discard, internal=True)
    while core.has_work():
        core.step()


WarmupProgress = Callable[[int, int], None]


def run_warmup(core: EngineCore, progress: WarmupProgress | None = None) -> None:
    """Run warm-up batches on ``core`` (engine thread not started yet).

    ``progress(done, total)`` is called after each batch, in warm-up requests.
    """
    config = core.config
    vocab = core.tokens.vocab_size
    page_size = core.page_size
    free = core.num_free_pages()
    decode_steps = 3

    def prompt(n: int, salt: int) -> tuple[int, ...]:
        return tuple((salt * 7919 + i) % vocab for i in range(1, n + 1))

    def request(i: int, n: int, greedy: bool) -> Request:
        return Request(
            request_id=f"{WARMUP_TENANT}-{i}",
            tenant=WARMUP_TENANT,
            prompt_ids=prompt(n, i),
            sampling=SamplingParams(temperature=0.0) if greedy else _SAMPLING,
            stopping=StoppingParams(max_tokens=decode_steps, ignore_eos=True),
            logprobs=0 if greedy else 2,
            bypass_prefix_cache=True,
        )

    batches: list[tuple[int, bool]] = []  # (size, is the long prefill)
    prefill_len = min(config.max_num_batched_tokens, config.max_model_len - decode_steps - 1)
    prefill_len = min(prefill_len, free * page_size - decode_steps - 1)
    if prefill_len >= 1:
        batches.append((1, True))
    pages_per_seq = -(-(2 + decode_steps) // page_size)
    batches += [(size, False) for size in config.warmup_decode_sizes
                if size <= config.max_num_seqs and size * pages_per_seq <= free]
    total = sum(size for size, _ in batches)
    counter = 0
    for size, is_prefill in batches:
        if is_prefill:
            _run(core, [request(counter, prefill_len, greedy=True)])
        else:
            _run(core, [request(counter + i, 2, greedy=i % 2 == 0) for i in range(size)])
        counter += size
        if progress is not None:
            progress(counter, total)
    core.purge(WARMUP_TENANT)
    # NOTE: left present for idle_grace_s, the warm-up tenant timed the first requests'
    # steps as if another tenant were there: one tenant's first second of 64 offline
    # prompts ran in 10 steps of ~210 tokens, against 5 of ~400 once retired (traced).
    core.retire(WARMUP_TENANT)
    log.info("engine_warmup_done", requests=counter, steps=core.num_steps)
