"""Shared prefixes in the timing channel: can a tenant that did not opt in to a declared
prefix tell, from its own time to first token, that the server holds it?

The tenants file declares one text of about 1,000 tokens; alice opts in, bob does not. Per
trial, bob purges his own cache, then sends P (the declared prefix's full pages, 1,008
tokens, and a fresh 16-token suffix) and a novel prompt Q of equal length, in alternating
order; alice sends the declared prefix with a fresh suffix of her own, her first request for
it. The judgement is the timing channel's (``test_timing_channel``: the same TOST at 5%
split over the same looks, the same margin): the confidence interval of bob's TTFT ratio,
P over Q, must lie inside [1/MARGIN, MARGIN]. Bob is reported no cached tokens, shared or
his own. Alice's requests read the 1,008 shared tokens; the same interval on alice (shared
hit) / bob cold must lie entirely below 1/MARGIN: the power control, showing that a read of
the shared pages would fail the first check.

Runs on the medium random model, as the timing channel does.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2_grpc
from service.admission.tenants import hash_key, new_api_key
from service.serve.app import EngineSizing
from tests.isolation.test_timing_channel import MARGIN, equivalence_trials
from tests.serverutil import ServerHandle, running_server
from tests.verify.calls import StreamResult, collect, gen_request
from tests.verify.recorder import Recorder
from tests.verify.scale import size
from tests.verify.stats import median, paired_log_ratio_ci

PROMPT = 1024
SUFFIX = 16
SHARED = PROMPT - SUFFIX  # the declared prefix's full pages: 63 of 16 tokens
SIZING = EngineSizing(kv_memory="96MiB", max_model_len=2048, warmup=False, dtype="float32")


def _declared_text(tokenizer: Any) -> str:
    """Plain words, one line, whose tokens (a text prompt's) hold exactly SHARED tokens of
    full pages: between SHARED and PROMPT - 1 tokens in all."""
    rng = random.Random(23)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words) + "\n", True)) < SHARED:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)))
    text = " ".join(words) + "\n"
    assert SHARED <= len(tokenizer.encode(text, True)) < PROMPT
    return text


@pytest.fixture(scope="module")
def declared(medium: Any) -> list[int]:
    """The declared prefix's full-page token ids."""
    return list(medium.tokenizer.encode(_declared_text(medium.tokenizer), True)[:SHARED])


@pytest.fixture(scope="module")
def srv(medium: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    keys = {name: new_api_key() for name in ("alice", "bob")}
    path: Path = tmp_path_factory.mktemp("shared-timing") / "tenants.toml"
    path.write_text("\n".join([
        "[shared_prefixes]", f"support = {json.dumps(_declared_text(medium.tokenizer))}", "",
        "[tenants.alice]", f'api_key_sha256 = ["{hash_key(keys["alice"]).hex()}"]',
        'shared_prefixes = ["support"]', "",
        "[tenants.bob]", f'api_key_sha256 = ["{hash_key(keys["bob"]).hex()}"]', "",
    ]), encoding="utf-8")
    with running_server(medium, path, sizing=SIZING) as handle:
        handle.keys.update(keys)
        yield handle


def _ttft(srv: ServerHandle, tenant: str, prompt: list[int]) -> StreamResult:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    result = collect(
        stub.Generate(gen_request(prompt, max_tokens=1), metadata=srv.auth(tenant), timeout=120)
    )
    assert result.ok and result.ttft is not None and result.started is not None, result.code
    return result


def _usage(srv: ServerHandle, tenant: str) -> cache_pb2.GetUsageResponse:
    stub = cache_pb2_grpc.CacheStub(srv.channel())
    usage: cache_pb2.GetUsageResponse = stub.GetUsage(
        cache_pb2.GetUsageRequest(), metadata=srv.auth(tenant)
    )
    return usage


@pytest.mark.timeout(size(600, 1800))
@pytest.mark.slow
def test_a_tenant_not_opted_in_sees_no_shared_prefix_in_ttft(
    srv: ServerHandle, declared: list[int], record: Recorder
) -> None:
    rng = random.Random(7)
    cache = cache_pb2_grpc.CacheStub(srv.channel())

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 384) for _ in range(n)]

    for tenant in ("alice", "bob"):  # first-call effects (allocations, lazy init) go here
        _ttft(srv, tenant, ids(PROMPT))
    def trial() -> tuple[StreamResult, list[int], list[int]]:
        first = _ttft(srv, "alice", declared + ids(SUFFIX))  # A's first request, shared
        cache.Purge(cache_pb2.PurgeRequest(), metadata=srv.auth("bob"))  # no own hit either
        return first, declared + ids(SUFFIX), ids(PROMPT)

    t = equivalence_trials(trial, lambda prompt: _ttft(srv, "bob", prompt))
    a_shared, b_cross, b_cold, a_hits, b_hits = t.control, t.cross, t.cold, t.control_hits, t.hits
    ratio, lo, hi, alpha = t.ratio, t.lo, t.hi, t.alpha
    shared_ratio, _, shared_hi = paired_log_ratio_ci(a_shared, b_cold, alpha)
    bob = _usage(srv, "bob")
    record.info("trials (pairs) until the interval decided", len(b_cold))
    record.info("B TTFT median on the declared prefix (s)", median(b_cross))
    record.info("B TTFT median on a novel prompt (s)", median(b_cold))
    record.info("B TTFT ratio, declared prefix / novel (Hodges-Lehmann)", round(ratio, 3))
    assert record(f"{1 - 2 * alpha:.1%} CI of B's TTFT ratio (not opted in), declared prefix / "
                  "novel (TOST)", f"[{lo:.3f}, {hi:.3f}]", f"inside [{1 / MARGIN:.3f}, {MARGIN}]",
                  lo > 1 / MARGIN and hi < MARGIN), [
        round(a / b, 3) for a, b in zip(b_cross, b_cold, strict=True)]
    reported = sum(b_hits) + bob.shared_prefix_hit_tokens
    assert record("cached and shared tokens reported to B (Started, GetUsage)", reported, "== 0",
                  reported == 0)
    assert record("A (opted in) shared tokens on its first request (control)", min(a_hits),
                  f"== {SHARED}", min(a_hits) == SHARED)
    record.info("A first request (shared) / B cold TTFT ratio (Hodges-Lehmann)",
                round(shared_ratio, 3))
    record.info("A TTFT median on its first request for the declared prefix (s)",
                median(a_shared))
    assert record("CI upper end, A first request (shared) / B cold (power: a real hit)",
                  round(shared_hi, 3), f"< {1 / MARGIN:.3f}", shared_hi < 1 / MARGIN)
