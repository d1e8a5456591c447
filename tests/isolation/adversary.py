"""Tenant B's adversarial traffic for the differential isolation test, and A's prompts.

B's probes are built from A's prompts so that, were the cache shared, B would be handed A's
pages: the exact prompt, A's full pages plus one token, and prompts that differ from A's only
in the last token of page 0 or page 1. Each of A's prompts starts with a unique tag, so no two
of them share a first page, and each gets exactly one probe: B's own history can never explain
a cached token on a probe.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tests.verify.calls import Metadata, StreamResult, collect_async, gen_request

PAGE = 16
PROBE_KINDS = ("exact", "pages+1", "page0 last token", "page1 last token")

_SUBJECTS = (
    "the water cycle",
    "binary search",
    "the French revolution",
    "photosynthesis",
    "a sourdough starter",
    "the Pythagorean theorem",
    "how vaccines work",
    "the Moon's phases",
    "compound interest",
    "plate tectonics",
    "a bicycle gearbox",
    "the TCP handshake",
    "honey bees",
    "the printing press",
    "black holes",
    "a haiku about rain",
    "recycling paper",
    "the violin",
    "the Silk Road",
    "volcanoes",
)
_TEMPLATES = (
    "Explain {s} to a ten-year-old in two sentences.",
    "Write a short, friendly paragraph about {s}.",
    "List three surprising facts about {s}.",
    "What is the most common misconception about {s}? Answer briefly.",
    "Summarize {s} in one sentence, then give an example.",
)
_CONTEXTS = (
    " Note: answer in plain English for a general audience, without lists or headings,"
    " and keep it brief.",
    " Context: the reader is curious but busy, so keep the answer short, concrete and"
    " free of jargon; prefer everyday words and one memorable image.",
)


def a_prompts(n: int) -> list[str]:
    """``n`` distinct instruction prompts of at least three pages; every other one carries a
    longer context."""
    out = []
    for i in range(n):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        template = _TEMPLATES[(i // len(_SUBJECTS)) % len(_TEMPLATES)]
        out.append(f"Q{i}: " + template.format(s=subject) + _CONTEXTS[i % 2])
    return out


def probe(ids: Sequence[int], index: int, vocab: int) -> tuple[str, list[int]]:
    """B's single probe of A's prompt number ``index``: (kind, token ids)."""
    kind = PROBE_KINDS[index % len(PROBE_KINDS)]
    ids = list(ids)
    if kind == "exact":
        return kind, ids
    if kind == "pages+1":
        full = max(1, (len(ids) - 1) // PAGE)
        return kind, ids[: full * PAGE + 1]
    if len(ids) <= 2 * PAGE:
        raise ValueError("probes need prompts longer than two pages")
    pos = PAGE - 1 if kind == "page0 last token" else 2 * PAGE - 1
    ids[pos] = (ids[pos] + 1) % vocab
    return kind, ids


def near_limit(rng: random.Random, max_model_len: int, max_tokens: int, vocab: int) -> list[int]:
    """A novel prompt that, with ``max_tokens``, fills the context to within a few tokens."""
    return [
        rng.randrange(3, vocab) for _ in range(max_model_len - max_tokens - rng.randrange(1, 4))
    ]


def mutated(ids: Sequence[int], vocab: int) -> list[int]:
    """A's prompt with its first token changed: looks like A's traffic, shares no page."""
    out = list(ids)
    out[0] = (out[0] + 7) % vocab
    return out


@dataclass(slots=True)
class Cancelled:
    code: grpc.StatusCode
    at: str


async def cancel_storm_stream(
    stub: Any, meta: Metadata, ids: list[int], rng: random.Random
) -> Cancelled:
    """One stream cancelled before Started, mid-prefill (on Started) or after 1-3 chunks."""
    call = stub.Generate(gen_request(ids, max_tokens=8), metadata=meta, timeout=120)
    point = rng.choice(("before", "prefill", "decode"))
    if point == "before":
        await asyncio.sleep(rng.uniform(0.0, 0.02))
    else:
        want = 0 if point == "prefill" else rng.randrange(1, 4)
        chunks = 0
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.WhichOneof("event") == "chunk":
                    chunks += 1
                if msg.WhichOneof("event") != "finished" and chunks >= want:
                    break
        except grpc.RpcError:
            pass
    call.cancel()
    return Cancelled(await call.code(), point)


async def run_stream(
    stub: Any, meta: Metadata, ids: list[int], max_tokens: int, logprobs: int = 0
) -> StreamResult:
    call = stub.Generate(
        gen_request(ids, max_tokens=max_tokens, logprobs=logprobs), metadata=meta, timeout=300
    )
    return await collect_async(call)
