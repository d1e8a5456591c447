"""The KV tier through a real server (``--kv-tier-dir``): a tenant at its KV share pushes its
own cached pages down to sealed files, and its next request that begins with them gets them
back, producing the tokens it produced before (greedy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protos.kvfence.v1 import cache_pb2, cache_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.serve.app import EngineSizing
from tests.serverutil import ServerHandle, TenantSpec, running_server

PROMPT_A = list(range(100, 140))  # 40 tokens: two full pages of 16 are cached
PROMPT_B = list(range(200, 240))


def _generate(srv: ServerHandle, ids: list[int]) -> tuple[int, list[int]]:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    request = inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=ids),
        sampling=inference_pb2.SamplingParams(temperature=0.0),
        stopping=inference_pb2.StoppingParams(max_tokens=4, ignore_eos=True),
    )
    cached, tokens = -1, []
    for response in stub.Generate(request, metadata=srv.auth("t")):
        if response.WhichOneof("event") == "started":
            cached = response.started.cached_prompt_tokens
        elif response.WhichOneof("event") == "chunk":
            tokens.extend(response.chunk.token_ids)
    return cached, tokens


def test_pages_pushed_out_by_the_tenants_own_share_come_back_from_the_tier(
    tiny_model: Any, tmp_path: Path
) -> None:
    sizing = EngineSizing(
        kv_memory="4MiB", max_model_len=256, warmup=False, dtype="float32",
        kv_tier_dir=str(tmp_path / "tier"), kv_tier_bytes="8MiB",
    )
    with running_server(tiny_model, {"t": TenantSpec(max_kv_pages=4)}, sizing=sizing) as srv:
        assert srv.engine.tier_bytes == 8 * 2**20
        cold, first = _generate(srv, PROMPT_A)
        _generate(srv, PROMPT_B)  # at its share of 4: its own oldest cached page goes down
        files = list((tmp_path / "tier").iterdir())
        assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
        cached, again = _generate(srv, PROMPT_A)
        assert (cold, cached) == (0, 32)
        assert again == first
        usage = cache_pb2_grpc.CacheStub(srv.channel()).GetUsage(
            cache_pb2.GetUsageRequest(), metadata=srv.auth("t")
        )
        assert usage.tier_hit_tokens >= 16 and usage.prefix_hit_tokens == 32
        assert srv.usage("t").max_tier_bytes == 8 * 2**20  # its whole weight's share
