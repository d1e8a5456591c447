"""The single-stream suite's out-of-process gRPC client (bench.grpc_client): it streams
from a real server in this process and hands back the same traces an in-process client
records; a client that fails says why."""

from __future__ import annotations

import asyncio

import pytest

from bench.common import Work
from bench.kvfence_runner import Sizing, grpc_server, run_grpc, run_grpc_elsewhere
from service.model.loader import LoadedModel


@pytest.mark.slow
def test_client_in_its_own_process_streams_what_an_in_process_client_gets(
    default_model: LoadedModel,
) -> None:
    work = [Work((1, 4093, 30, 2260, 28), 5)]
    sizing = Sizing(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, kv_bytes=8 << 20)

    async def both() -> tuple[list[int], list[int], int]:
        async with grpc_server(default_model, ["t"], sizing) as (target, keys, _):
            _, there = await run_grpc_elsewhere(target, keys, work, ["t"], bypass_prefix_cache=True)
            _, here = await run_grpc(target, keys, work, ["t"], bypass_prefix_cache=True)
            with pytest.raises(RuntimeError, match=r"bench\.grpc_client failed"):
                await run_grpc_elsewhere(target, {"t": "kvf_wrong"}, work, ["t"])
        (a,), (b,) = there, here
        assert a.finish_reason == b.finish_reason and len(a.chunk_times) >= 1
        assert a.start <= a.chunk_times[0] <= a.end
        return a.token_ids, b.token_ids, a.output_tokens

    there, here, tokens = asyncio.run(both())
    assert tokens == 5 and there == here  # greedy: the same tokens either way
