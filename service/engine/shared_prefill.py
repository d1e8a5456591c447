"""Prefilling the operator's shared prefixes (kvcache/shared_prefix.py).

A publication is an internal sequence of kvcache's: it runs through the ordinary step path
(the fence in ``begin_step``, the model forward, ``commit``) on the engine thread, between
steps, in chunks no larger than a step's token budget. Its logits are computed for one row
and never sampled. The commit of its last token seals the pages; freeing the sequence before
that (a failed forward) leaves nothing published.
"""

from __future__ import annotations

import torch

from kvcache.results import SharedPublish
from service.engine.runner import BatchInputs, ModelRunner
from service.engine.scheduler import Scheduler


def prefill_shared(
    scheduler: Scheduler, runner: ModelRunner, pub: SharedPublish, chunk: int
) -> None:
    """Compute ``pub``'s pages, ``chunk`` tokens at a time, then free its sequence. Raises
    what the forward raised (the pages are then freed unpublished)."""
    total = len(pub.token_ids)
    device = runner.device
    try:
        for start in range(0, total, chunk):
            num = min(chunk, total - start)
            attn = scheduler.shared_step(pub, start, num)
            inputs = BatchInputs(
                torch.tensor(pub.token_ids[start : start + num], dtype=torch.long, device=device),
                torch.arange(start, start + num, dtype=torch.long, device=device),
                torch.tensor([num - 1], dtype=torch.long, device=device),
            )
            runner.forward(inputs, attn)
            scheduler.shared_commit(pub, start + num)
    finally:
        scheduler.shared_done(pub)
