"""A grammar compile holds its caller's stream slot until the compile thread is done: a
tenant capped at one stream that cancels a call mid-compile cannot start another until the
compile has ended (otherwise cancelled calls would keep compile threads busy past the cap)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from protos.kvfence.v1 import inference_pb2_grpc
from service.structured.grammar import CompiledGrammar, GrammarSpec
from tests.serverutil import ServerHandle
from tests.service.rpc import request


def test_a_cancelled_compile_keeps_the_stream_slot_until_it_ends(
    srv: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    grammars = srv.stack.grammars
    assert grammars is not None
    release = threading.Event()
    started = threading.Event()
    compile_ = grammars.compile

    def slow_compile(tenant: str, spec: GrammarSpec) -> CompiledGrammar:  # takes a while
        started.set()
        release.wait(30)
        return compile_(tenant, spec)

    monkeypatch.setattr(grammars, "compile", slow_compile)
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    auth = srv.auth("one_stream")
    try:
        slow = request("x", max_tokens=1)
        slow.response_format.regex = "[a-z]{1,4}"
        call = stub.Generate(slow, metadata=auth, timeout=60)
        assert started.wait(30)
        call.cancel()
        time.sleep(0.2)  # the cancel has reached the server
        try:
            list(stub.Generate(request("Hi", max_tokens=1), metadata=auth, timeout=30))
            refused = None
        except grpc.RpcError as err:
            refused = err.code()
        assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        release.set()
        monkeypatch.undo()
    deadline = time.monotonic() + 60
    while True:  # once the compile thread ends, the slot is free again
        try:
            list(stub.Generate(request("Hi", max_tokens=1), metadata=auth, timeout=30))
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the slot was never freed"
            time.sleep(0.1)
