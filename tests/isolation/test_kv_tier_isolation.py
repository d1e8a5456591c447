"""The KV tier's isolation through a real server (``--kv-tier-dir``): what one tenant's
evicted pages become in the tier is its own alone.

Each tenant holds a KV share of 4 pages, so its own next prompts push its older cached pages
down into sealed files. Three tests:

- another tenant sending the same prompts never gets them back (its own namespace, its own
  key), while the owner does;
- one byte flipped in every tier file turns the owner's restore into a miss: the record
  fails authentication, is counted in ``tier_rejected`` and deleted, and the owner computes
  the tokens again (the same greedy tokens);
- ``Purge`` empties the caller's part of the tier (GetUsage ``tier_bytes`` 0, none of its
  files left) and leaves another tenant's part as it was.

Runs on the tiny random model: the tier's checks do not depend on prefill cost.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2_grpc
from service.serve.app import EngineSizing
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.calls import StreamResult, collect, gen_request
from tests.verify.recorder import Recorder
from tests.verify.scale import size

PROMPT = 40  # two full pages of 16 are cached; the third holds the rest and the output
ROUNDS = size(3, 8)  # prompts per tenant, each pushing the one before into the tier


def _sizing(tier: Path) -> EngineSizing:
    return EngineSizing(
        kv_memory="4MiB", max_model_len=256, warmup=False, dtype="float32",
        kv_tier_dir=str(tier), kv_tier_bytes="8MiB",
    )


@pytest.fixture
def tier_dir(tmp_path: Path) -> Path:
    return tmp_path / "tier"


@pytest.fixture
def srv(tiny: Any, tier_dir: Path) -> Iterator[ServerHandle]:
    tenants = {"alice": TenantSpec(max_kv_pages=4), "bob": TenantSpec(max_kv_pages=4)}
    with running_server(tiny, tenants, sizing=_sizing(tier_dir)) as handle:
        yield handle


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(PROMPT)] for _ in range(n)]


def _generate(srv: ServerHandle, tenant: str, ids: list[int]) -> StreamResult:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    result = collect(
        stub.Generate(gen_request(ids, max_tokens=4), metadata=srv.auth(tenant), timeout=60)
    )
    assert result.ok and result.started is not None, result.code
    return result


def _cached(result: StreamResult) -> int:
    return result.started.cached_prompt_tokens if result.started else -1


def _usage(srv: ServerHandle, tenant: str) -> cache_pb2.GetUsageResponse:
    stub = cache_pb2_grpc.CacheStub(srv.channel())
    usage: cache_pb2.GetUsageResponse = stub.GetUsage(
        cache_pb2.GetUsageRequest(), metadata=srv.auth(tenant)
    )
    return usage


def _files(tier: Path) -> set[str]:
    return {p.name for p in tier.iterdir()}


def test_another_tenant_never_hits_a_tenants_tier(srv: ServerHandle, record: Recorder) -> None:
    prompts = _prompts(1, ROUNDS)
    for ids in prompts:  # each pushes alice's older pages into her part of the tier
        _generate(srv, "alice", ids)
    held = srv.usage("alice").tier_prefixes
    bob = [_cached(_generate(srv, "bob", ids)) for ids in prompts]
    usage = _usage(srv, "bob")
    reported = sum(bob) + usage.tier_hit_tokens + usage.prefix_hit_tokens
    assert record("B cached tokens on prompts A holds in its tier (Started, GetUsage)", reported,
                  "== 0", reported == 0), bob
    assert record("A records in the tier while B sent its prompts (control)", held, "> 0",
                  held > 0)
    before = _usage(srv, "alice").tier_hit_tokens
    for ids in prompts:
        _generate(srv, "alice", ids)
    restored = _usage(srv, "alice").tier_hit_tokens - before
    assert record("A tokens restored from its tier on its repeats (control)", restored, "> 0",
                  restored > 0)


def test_a_tier_file_with_one_byte_flipped_is_a_miss(
    srv: ServerHandle, tier_dir: Path, record: Recorder
) -> None:
    control, tampered = _prompts(2, 2), _prompts(3, 2)
    for ids in control:
        _generate(srv, "alice", ids)
    before = _usage(srv, "alice").tier_hit_tokens
    _generate(srv, "alice", control[0])
    restored = _usage(srv, "alice").tier_hit_tokens - before
    assert record("A tokens restored from its tier, no byte flipped (control)", restored, "> 0",
                  restored > 0)
    cold = _generate(srv, "alice", tampered[0])
    _generate(srv, "alice", tampered[1])  # tampered[0]'s oldest page goes down
    flipped = 0
    for path in sorted(tier_dir.iterdir()):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))  # the file keeps its mode (0600)
        flipped += 1
    rejected = srv.stats().tier_rejected
    before = _usage(srv, "alice").tier_hit_tokens
    again = _generate(srv, "alice", tampered[0])
    restored = _usage(srv, "alice").tier_hit_tokens - before
    refused = srv.stats().tier_rejected - rejected
    record.info("tier files with one byte flipped", flipped)
    assert record("A tokens restored from its tier after one byte of each file was flipped",
                  restored, "== 0", restored == 0)
    assert record("tier records refused on the way back (tier_rejected)", refused, ">= 1",
                  refused >= 1)
    record.info("A cached tokens on that request (pool pages before the refused one)",
                _cached(again))
    record.info("A greedy tokens after the refused record equal its first run's",
                again.tokens == cold.tokens)


def test_purge_empties_the_callers_part_of_the_tier(
    srv: ServerHandle, tier_dir: Path, record: Recorder
) -> None:
    for ids in _prompts(4, ROUNDS):
        _generate(srv, "alice", ids)
    alice_files = _files(tier_dir)  # only alice's requests ran so far
    for ids in _prompts(5, ROUNDS):
        _generate(srv, "bob", ids)
    bob_files = _files(tier_dir) - alice_files
    bob_bytes = _usage(srv, "bob").tier_bytes
    held = _usage(srv, "alice").tier_bytes
    assert record("A tier bytes before its Purge (control)", held, "> 0", held > 0)
    cache_pb2_grpc.CacheStub(srv.channel()).Purge(
        cache_pb2.PurgeRequest(), metadata=srv.auth("alice")
    )
    left = _usage(srv, "alice").tier_bytes
    assert record("A tier bytes after its Purge (GetUsage)", left, "== 0", left == 0)
    files = _files(tier_dir)
    assert record("A tier files left after its Purge", len(files & alice_files), "== 0",
                  not files & alice_files)
    kept = _usage(srv, "bob").tier_bytes == bob_bytes > 0 and files == bob_files
    assert record("B tier bytes and files unchanged by A's Purge", kept, "True", kept)
