from __future__ import annotations

import threading
import time

import grpc
import pytest

from clients import (
    Chunk,
    Client,
    ClientError,
    DeadlineExceeded,
    Finished,
    Started,
    Unauthenticated,
    Usage,
)
from clients.types import ModelInfo, Tokenized
from protos.kvfence.v1 import inference_pb2
from tests.clients.fakeserver import GOOD_KEY, FakeInference, serve


def test_events_arrive_in_order_and_text_matches_generate_text(
    fake: FakeInference, target: str
) -> None:
    with Client(target, api_key=GOOD_KEY) as client:
        events = list(client.generate("hi", max_tokens=5, client_request_id="c-1"))
        result = client.generate_text("hi", max_tokens=5)
    assert isinstance(events[0], Started)
    assert events[0].client_request_id == "c-1" and events[0].request_id == "req-1"
    chunks = events[1:-1]
    assert [c.text for c in chunks if isinstance(c, Chunk)] == list(fake.chunks)
    assert [c.token_ids for c in chunks if isinstance(c, Chunk)] == [
        (100,),
        (101,),
        (102,),
        (103,),
        (104,),
    ]
    assert isinstance(events[-1], Finished) and events[-1].reason == "length"
    assert result.text == "Hello, world" == "".join(fake.chunks)
    assert result.finish_reason == "length"
    assert result.usage == Usage(prompt_tokens=3, completion_tokens=5, cached_prompt_tokens=1)
    assert result.token_ids == (100, 101, 102, 103, 104)
    assert result.request_id == "req-2"


def test_key_travels_as_bearer_metadata_on_an_insecure_channel(
    fake: FakeInference, target: str
) -> None:
    with Client(target, api_key=GOOD_KEY) as client:
        client.generate_text("hi")
    assert fake.seen.metadata[0]["authorization"] == f"Bearer {GOOD_KEY}"


def test_key_is_read_from_the_environment(
    fake: FakeInference, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFENCE_API_KEY", GOOD_KEY)
    with Client(target) as client:
        assert client.generate_text("hi").text == "Hello, world"
    monkeypatch.setenv("KVFENCE_API_KEY", "wrong")
    with Client(target) as client, pytest.raises(Unauthenticated, match="invalid API key"):
        client.generate_text("hi")


def test_chat_sends_messages(fake: FakeInference, target: str) -> None:
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with Client(target, api_key=GOOD_KEY) as client:
        assert client.chat(history, temperature=0.0).text == "Hello, world"
    sent = fake.seen.requests[0]
    assert isinstance(sent, inference_pb2.GenerateRequest)
    assert [(m.role, m.content) for m in sent.chat.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
    ]
    assert sent.chat.add_generation_prompt is True
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0


def test_unary_calls(fake: FakeInference, target: str) -> None:
    with Client(target, api_key=GOOD_KEY) as client:
        assert client.tokenize("a bb ccc") == Tokenized((1, 2, 3), ("a", "bb", "ccc"))
        assert client.models() == (ModelInfo("fake", "llama", 2048, 49152, "float32"),)
        usage = client.usage()
        assert (usage.pages_in_use, usage.pages_cached, usage.hit_rate) == (2, 5, 0.75)
        assert usage.quotas.max_kv_pages == 100
        assert client.purge() == 5


def test_bad_input_raises_before_anything_is_sent(fake: FakeInference, target: str) -> None:
    with Client(target, api_key=GOOD_KEY) as client, pytest.raises(ClientError):
        client.generate("a", token_ids=[1])
    assert fake.seen.requests == []


def test_deadline_covers_the_stream_and_is_sent_to_the_server(target: str) -> None:
    slow = FakeInference(first_chunk_delay_s=3.0)
    with serve(slow) as slow_target, Client(slow_target, api_key=GOOD_KEY) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded) as caught:
            client.generate_text("hi", timeout=0.4)
        assert time.monotonic() - start < 2.0
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert slow.generate_calls == 1  # a deadline is never retried
    remaining = slow.seen.timeouts[0]
    assert remaining is not None and 0 < remaining <= 0.45


def test_client_default_timeout_applies_to_unary_calls(fake: FakeInference, target: str) -> None:
    with Client(target, api_key=GOOD_KEY, timeout=7.0) as client:
        client.usage()
        client.usage(timeout=2.0)
    first, second = fake.seen.timeouts
    assert first is not None and 6.0 < first <= 7.05
    assert second is not None and 1.0 < second <= 2.05


def test_closing_the_client_closes_the_channel(target: str) -> None:
    with Client(target, api_key=GOOD_KEY) as client:
        pass
    with pytest.raises(ValueError, match="closed channel"):
        client.purge()


def test_closing_a_stream_early_cancels_the_call() -> None:
    gate = threading.Event()
    fake = FakeInference(gate=gate)
    with serve(fake) as target, Client(target, api_key=GOOD_KEY) as client:
        try:
            events = client.generate("hi")
            assert isinstance(next(events), Started)
            assert next(events) == Chunk((100,), "Hel")
            events.close()
            deadline = time.monotonic() + 2.0
            while not fake.cancelled and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            gate.set()
    assert fake.cancelled == [True]


def test_completed_calls_are_not_reported_as_cancelled(fake: FakeInference, target: str) -> None:
    with Client(target, api_key=GOOD_KEY) as client:
        client.generate_text("hi")
    deadline = time.monotonic() + 2.0
    while not fake.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.cancelled == [False]
