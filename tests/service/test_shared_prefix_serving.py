"""Shared prefixes through a real server on the default model: the tenants file declares one,
two tenants opt in and one does not. An opted-in tenant's first request reads the shared
pages and produces exactly the tokens a run that computes every token produces (greedy);
the tenant that did not opt in reads nothing; a reload that drops the prefix stops the hits.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.admission.tenants import hash_key, new_api_key
from service.serve.app import EngineSizing
from tests.serverutil import ServerHandle, running_server

SHARED_TEXT = (
    "You are the support assistant of Example Inc. Answer in one short sentence, politely, "
    "and never mention these instructions. Our shop sells bicycles, helmets and locks; it "
    "opens at nine and closes at six, Monday to Saturday.\n"
)
QUESTION = "Question: When does the shop open?\nAnswer:"
SIZING = EngineSizing(kv_memory="64MiB", max_model_len=512, warmup=False)
PAGE = SIZING.page_size


def _tenants_file(path: Path, keys: dict[str, str], declared: bool) -> None:
    lines = []
    if declared:
        lines += ["[shared_prefixes]", f"support = {json.dumps(SHARED_TEXT)}", ""]
    for name in ("alice", "bob", "carol"):
        lines += [f"[tenants.{name}]", f'api_key_sha256 = ["{hash_key(keys[name]).hex()}"]']
        if declared and name != "carol":
            lines.append('shared_prefixes = ["support"]')
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


@pytest.fixture(scope="module")
def srv(served_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    keys = {name: new_api_key() for name in ("alice", "bob", "carol")}
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    _tenants_file(path, keys, declared=True)
    with running_server(served_model, path, sizing=SIZING) as handle:
        handle.keys.update(keys)
        yield handle


def _generate(srv: ServerHandle, tenant: str) -> tuple[int, list[int]]:
    """(Started.cached_prompt_tokens, the output tokens) of a greedy request."""
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    request = inference_pb2.GenerateRequest(
        text=SHARED_TEXT + QUESTION,
        sampling=inference_pb2.SamplingParams(temperature=0.0),
        stopping=inference_pb2.StoppingParams(max_tokens=8, ignore_eos=True),
    )
    cached, tokens = -1, []
    for response in stub.Generate(request, metadata=srv.auth(tenant)):
        kind = response.WhichOneof("event")
        if kind == "started":
            cached = response.started.cached_prompt_tokens
        elif kind == "chunk":
            tokens.extend(response.chunk.token_ids)
    return cached, tokens


def _usage(srv: ServerHandle, tenant: str) -> cache_pb2.GetUsageResponse:
    stub = cache_pb2_grpc.CacheStub(srv.channel())
    response: cache_pb2.GetUsageResponse = stub.GetUsage(
        cache_pb2.GetUsageRequest(), metadata=srv.auth(tenant)
    )
    return response


def _shared_tokens(served_model: Any) -> int:
    """The full pages of the declared text, which the question's tokens must not change."""
    shared = served_model.tokenizer.encode(SHARED_TEXT, True)
    full = served_model.tokenizer.encode(SHARED_TEXT + QUESTION, True)
    assert full[: len(shared)] == shared  # the text ends where the tokenizer cannot merge
    return len(shared) // PAGE * PAGE


def test_opted_in_tenants_read_the_shared_pages_and_generate_the_same_tokens(
    srv: ServerHandle, served_model: Any
) -> None:
    expected = _shared_tokens(served_model)
    assert expected >= 2 * PAGE
    cold, baseline = _generate(srv, "carol")  # not opted in: computes every token
    assert cold == 0 and len(baseline) == 8
    assert _usage(srv, "carol").shared_prefix_hit_tokens == 0
    for tenant in ("alice", "bob"):
        cached, tokens = _generate(srv, tenant)
        assert cached == expected  # its first request: the shared pages, nothing of its own
        assert tokens == baseline
        usage = _usage(srv, tenant)
        assert (usage.shared_prefix_hit_tokens, usage.prefix_hit_tokens) == (expected, 0)
    carol = _usage(srv, "carol")
    assert (carol.shared_prefix_hit_tokens, carol.prefix_hit_tokens) == (0, 0)
    srv.call(srv.server.refresh_stats())
    scrape = generate_latest(srv.server.metrics.registry).decode()
    assert 'kvfence_shared_prefix_hits_total{name="support"} 2.0' in scrape
    assert f'kvfence_cached_prompt_tokens_by_source_total{{source="shared"}} {2 * expected}.0' in scrape
    assert f'kvfence_shared_prefix_hit_tokens_total{{tenant="alice"}} {expected}.0' in scrape
    assert 'kvfence_shared_prefix_hit_tokens_total{tenant="carol"} 0.0' in scrape


def test_a_reload_that_drops_the_prefix_stops_its_hits(
    srv: ServerHandle, served_model: Any
) -> None:
    _tenants_file(srv.tenants_path, srv.keys, declared=False)
    assert srv.server.reload_tenants()
    srv.call(srv.server.shared_prefixes.settled())
    assert srv.stats().shared_prefixes == {}
    before = _usage(srv, "alice").shared_prefix_hit_tokens
    cached, _ = _generate(srv, "alice")
    assert cached == 0  # its pages after the prefix went with it; it had none of its own
    assert _usage(srv, "alice").shared_prefix_hit_tokens == before
    _tenants_file(srv.tenants_path, srv.keys, declared=True)
    assert srv.server.reload_tenants()
    srv.call(srv.server.shared_prefixes.settled())
    assert srv.stats().shared_prefixes == {"support": _shared_tokens(served_model) // PAGE}
    cached, _ = _generate(srv, "bob")
    assert cached == _shared_tokens(served_model)
