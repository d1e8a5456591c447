from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing

import pytest

from clients import AsyncClient, Chunk, DeadlineExceeded, Finished, Started, Unauthenticated
from clients.types import GenerateEvent, ModelInfo, Tokenized
from tests.clients.fakeserver import GOOD_KEY, FakeInference, serve


def test_stream_order_text_and_unary_calls(fake: FakeInference, target: str) -> None:
    async def main() -> tuple[list[GenerateEvent], str, object]:
        async with AsyncClient(target, api_key=GOOD_KEY) as client:
            events = [e async for e in client.generate("hi", client_request_id="a-1")]
            result = await client.generate_text("hi")
            others = (
                await client.tokenize("a bb"),
                await client.models(),
                (await client.usage()).pages_cached,
                await client.purge(),
                (await client.chat([{"role": "user", "content": "x"}])).text,
            )
            return events, result.text, others

    events, text, others = asyncio.run(main())
    assert isinstance(events[0], Started) and events[0].client_request_id == "a-1"
    assert [e.text for e in events[1:-1] if isinstance(e, Chunk)] == list(fake.chunks)
    assert isinstance(events[-1], Finished) and len(events) == 2 + len(fake.chunks)
    assert text == "Hello, world"
    assert others == (
        Tokenized((1, 2), ("a", "bb")),
        (ModelInfo("fake", "llama", 2048, 49152, "float32"),),
        5,
        5,
        "Hello, world",
    )
    assert fake.seen.metadata[0]["authorization"] == f"Bearer {GOOD_KEY}"


def test_typed_error_and_deadline() -> None:
    slow = FakeInference(first_chunk_delay_s=3.0)

    async def main(target: str) -> float:
        async with AsyncClient(target, api_key="wrong") as bad:
            with pytest.raises(Unauthenticated, match="invalid API key"):
                await bad.generate_text("hi")
        async with AsyncClient(target, api_key=GOOD_KEY) as client:
            start = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await client.generate_text("hi", timeout=0.4)
            return time.monotonic() - start

    with serve(slow) as target:
        assert asyncio.run(main(target)) < 2.0
    assert slow.generate_calls == 1


def test_closing_a_stream_early_cancels_the_call() -> None:
    gate = threading.Event()  # holds the server before its second chunk
    fake = FakeInference(gate=gate)

    async def main(target: str) -> list[str]:
        texts: list[str] = []
        async with AsyncClient(target, api_key=GOOD_KEY) as client:
            async with aclosing(client.generate("hi")) as events:
                async for event in events:
                    if isinstance(event, Chunk):
                        texts.append(event.text)
                        break
            for _ in range(100):
                if fake.cancelled:
                    break
                await asyncio.sleep(0.02)
        return texts

    with serve(fake) as target:
        try:
            assert asyncio.run(main(target)) == ["Hel"]
        finally:
            gate.set()
    assert fake.cancelled == [True]
