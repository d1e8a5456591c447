"""A grammar compile holds its caller's stream slot until the compile thread is done: a
tenant capped at one stream that cancels a call mid-compile cannot start another until the
compile has ended (otherwise cancelled calls would keep compile threads busy past the cap)."""

from __future__ import annotations

import random
import time

import grpc

from protos.kvfence.v1 import inference_pb2_grpc
from tests.serverutil import ServerHandle
from tests.service.rpc import request


def _expensive_grammar(seed: int) -> str:
    """~58 KB of unique literals: over a second to compile here, never a cache hit."""
    rng = random.Random(seed)
    words = {"".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(8)) for _ in range(4500)}
    return "start: " + " | ".join(f'"{w}"' for w in words)


def test_a_cancelled_compile_keeps_the_stream_slot_until_it_ends(srv: ServerHandle) -> None:
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    auth = srv.auth("one_stream")
    slow = request("x", max_tokens=1)
    slow.response_format.lark_grammar = _expensive_grammar(time.monotonic_ns())
    call = stub.Generate(slow, metadata=auth, timeout=60)
    time.sleep(0.3)  # the compile is under way
    call.cancel()
    try:
        list(stub.Generate(request("Hi", max_tokens=1), metadata=auth, timeout=30))
        refused = None
    except grpc.RpcError as err:
        refused = err.code()
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    deadline = time.monotonic() + 60
    while True:  # once the compile thread ends, the slot is free again
        try:
            list(stub.Generate(request("Hi", max_tokens=1), metadata=auth, timeout=30))
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the slot was never freed"
            time.sleep(0.1)
