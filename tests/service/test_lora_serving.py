"""Per-tenant LoRA adapters through a real server (gRPC and HTTP on 127.0.0.1 port 0): each
adapter's tokens equal its peft-merged model, a step mixing adapters and the base gives every
request its alone tokens, and another tenant's adapter is indistinguishable from no adapter."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from protos.kvfence.v1 import inference_pb2
from service.serve.kvfence_server import ServerOptions
from tests.fixtures.tiny_lora import write_random_lora
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.service.rpc import details, generate, request, stubs, usage
from tools.parity.checks import greedy_ours, hf_agrees_with_greedy

PROMPT = [5, 17, 42, 99, 7, 230, 11, 64, 3, 150, 77, 8, 21, 33, 190, 12, 61, 18, 40, 4]
LONG = list(range(100, 160))  # three full 16-token pages, a prefix no other test sends
TOKENS = 16


@dataclass(frozen=True, slots=True)
class Adapters:
    dirs: dict[str, Path]
    merged: dict[str, Any]


def _hf(tiny_llama_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    root = tmp_path_factory.mktemp("adapters")
    dirs: dict[str, Path] = {}
    merged: dict[str, Any] = {}
    for i, (name, rank) in enumerate([("a1", 8), ("a2", 64), ("a3", 8), ("g1", 8)]):
        dirs[name] = root / name
        merged[name] = write_random_lora(
            _hf(tiny_llama_dir), dirs[name], rank=rank, seed=10 + i, std=0.08
        )
    return Adapters(dirs, merged)


def _tenants(a: Adapters) -> dict[str, TenantSpec]:
    return {
        "acme": TenantSpec(adapters=tuple((n, str(a.dirs[n])) for n in ("a1", "a2", "a3"))),
        "globex": TenantSpec(adapters=(("g1", str(a.dirs["g1"])),)),
    }


@pytest.fixture(scope="module")
def srv(tiny_model: Any, adapters: Adapters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    with running_server(
        tiny_model,
        _tenants(adapters),
        options=ServerOptions(http_port=0),
        tenants_dir=tmp_path_factory.mktemp("lora-tenants"),
    ) as handle:
        yield handle


def tokens(responses: list[inference_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses if r.WhichOneof("event") == "chunk" for t in r.chunk.token_ids]


def run(srv: ServerHandle, tenant: str, model: str, ids: list[int] = PROMPT, **kw: Any) -> list[inference_pb2.GenerateResponse]:
    return generate(srv, tenant, request(ids=ids, max_tokens=TOKENS, model=model, **kw))


def test_each_adapter_equals_its_peft_merged_model_and_the_base_is_unchanged(
    srv: ServerHandle, adapters: Adapters, tiny_model: Any
) -> None:
    base = tokens(run(srv, "acme", ""))
    assert base == greedy_ours(tiny_model.model, PROMPT, TOKENS)
    assert tokens(run(srv, "acme", srv.server.prep.model.name)) == base
    for tenant, name in (("acme", "a1"), ("acme", "a2"), ("globex", "g1")):
        out = run(srv, tenant, name)
        assert out[0].started.model == name
        got = tokens(out)
        assert got != base
        assert hf_agrees_with_greedy(adapters.merged[name], PROMPT, got), name


def test_a_step_mixing_three_adapters_and_the_base_gives_each_its_alone_tokens(
    srv: ServerHandle,
) -> None:
    models = ["a1", "a2", "a3", ""]
    alone = {m: tokens(run(srv, "acme", m, bypass_prefix_cache=True)) for m in models}
    assert len({tuple(t) for t in alone.values()}) == 4
    with ThreadPoolExecutor(len(models) * 2) as pool:
        with srv.paused_engine():  # every request waits in the inbox: one admission step
            futures = [
                pool.submit(run, srv, "acme", m, bypass_prefix_cache=True) for m in models * 2
            ]
            time.sleep(0.5)
        together = [tokens(f.result(60)) for f in futures]
    assert together == [alone[m] for m in models * 2]


def test_another_tenants_adapter_is_refused_exactly_like_a_name_that_exists_nowhere(
    srv: ServerHandle,
) -> None:
    def refusal(tenant: str, model: str) -> tuple[Any, str, dict[str, Any]]:
        with pytest.raises(grpc.RpcError) as err:
            run(srv, tenant, model)
        return err.value.code(), err.value.details(), details(err.value)

    unknown = refusal("globex", "no-such-adapter")
    assert unknown[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal("globex", "a1") == unknown
    assert refusal("acme", "g1") == refusal("acme", "no-such-adapter") == unknown


def test_model_lists_show_the_base_and_the_callers_own_adapters_only(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    base = srv.server.prep.model.name

    def listed(tenant: str) -> list[tuple[str, str]]:
        resp = inference.ListModels(inference_pb2.ListModelsRequest(), metadata=srv.auth(tenant))
        return [(m.name, m.base_model) for m in resp.models]

    assert listed("acme") == [(base, ""), ("a1", base), ("a2", base), ("a3", base)]
    assert listed("globex") == [(base, ""), ("g1", base)]
    assert srv.server.http is not None
    http = urllib.request.Request(
        f"http://127.0.0.1:{srv.server.http.port}/v1/models",
        headers={"Authorization": f"Bearer {srv.keys['globex']}"},
    )
    with urllib.request.urlopen(http, timeout=30) as resp:
        ids = [m["id"] for m in json.load(resp)["data"]]
    assert ids == [base, "g1"]


def test_adapters_and_the_base_never_share_cached_prefix_pages(srv: ServerHandle) -> None:
    def cached(model: str) -> int:
        return run(srv, "globex", model, ids=LONG)[0].started.cached_prompt_tokens

    assert cached("") == 0
    assert cached("") == 48  # the base hits its own pages
    assert cached("g1") == 0  # the adapter never sees the base's
    assert cached("g1") == 48
    assert cached("") == 48


def test_usage_counts_each_adapters_requests_and_tokens_for_its_tenant(srv: ServerHandle) -> None:
    before = {a.name: a for a in usage(srv, "acme").adapters}
    run(srv, "acme", "a3")
    after = {a.name: a for a in usage(srv, "acme").adapters}
    assert sorted(after) == ["a1", "a2", "a3"]
    assert after["a3"].requests == before["a3"].requests + 1
    assert after["a3"].prompt_tokens == before["a3"].prompt_tokens + len(PROMPT)
    assert after["a3"].completion_tokens == before["a3"].completion_tokens + TOKENS
    assert after["a3"].resident
    assert after["a1"].requests == before["a1"].requests
    assert [a.name for a in usage(srv, "globex").adapters] == ["g1"]


def _adapter_bytes(config: Any, rank: int) -> int:
    """float32 A and B of all seven projections, fused as the decoder holds them (q|k|v and
    gate|up with block-diagonal B)."""
    h, i, q, kv, n = (config.hidden_size, config.intermediate_size, config.q_size,
                      config.kv_size, config.num_layers)
    per_layer = (3 * rank * h + (q + 2 * kv) * 3 * rank) + (rank * q + h * rank) + (
        2 * rank * h + 2 * i * 2 * rank) + (rank * i + h * rank)
    return 4 * n * per_layer


def test_each_tenants_adapters_are_counted_against_its_own_kv_share(
    srv: ServerHandle, tiny_model: Any
) -> None:
    from kvcache.pool import page_bytes

    config = tiny_model.model.config
    page = page_bytes(config.num_layers, srv.engine.page_size, config.num_kv_heads,
                      config.head_dim, tiny_model.model.kv_dtype)
    share = srv.engine.num_pages // 2  # two tenants of weight 1
    acme = sum(_adapter_bytes(config, r) for r in (8, 64, 8))
    globex = _adapter_bytes(config, 8)
    assert usage(srv, "acme").quotas.max_kv_pages == share - -(-acme // page)
    assert usage(srv, "globex").quotas.max_kv_pages == share - -(-globex // page)
