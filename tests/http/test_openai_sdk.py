"""The official ``openai`` SDK against a real server: chat and completions, streaming and
not, ``n``, usage and cached tokens, logprobs."""

from __future__ import annotations

from typing import Any

from tests.http.conftest import client
from tests.serverutil import ServerHandle

MESSAGES = [{"role": "user", "content": "Hello, world! How are you today?"}]


def _model(srv: ServerHandle) -> str:
    return str(srv.stack.model.name)


def test_models_lists_the_served_model_for_permitted_tenants(srv: ServerHandle) -> None:
    assert [m.id for m in client(srv).models.list().data] == [_model(srv)]
    assert client(srv, "other_model").models.list().data == []


def test_chat_non_streaming_matches_the_grpc_greedy_output(srv: ServerHandle) -> None:
    from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc

    c = client(srv)
    r = c.chat.completions.create(
        model=_model(srv), messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 12
    stub = inference_pb2_grpc.InferenceStub(srv.channel())
    req = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(
            messages=[inference_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])]
        ),
        sampling=inference_pb2.SamplingParams(temperature=0.0),
        stopping=inference_pb2.StoppingParams(max_tokens=12, ignore_eos=True),
    )
    grpc_text = "".join(
        m.chunk.text for m in stub.Generate(req, metadata=srv.auth("acme")) if m.HasField("chunk")
    )
    assert choice.message.content == grpc_text
    assert r.usage.prompt_tokens > 0


def test_chat_streaming_with_usage(srv: ServerHandle) -> None:
    c = client(srv)
    chunks = list(
        c.chat.completions.create(
            model=_model(srv),
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert content[0].choices[0].delta.role == "assistant"
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [f.choices[0].finish_reason for f in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage is None for ch in chunks[:-1])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    r = c.chat.completions.create(
        model=_model(srv), messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text == r.choices[0].message.content


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(srv: ServerHandle) -> None:
    """vLLM's ``continuous_usage_stats`` (GuideLLM sends it): with include_usage, each chunk
    carries the usage so far; without include_usage it changes nothing."""
    def stream(options: dict[str, bool]) -> list[Any]:
        return list(client(srv).completions.create(
            model=_model(srv), prompt="The quick brown", max_tokens=6, n=2, temperature=0,
            stream=True, stream_options=options, extra_body={"ignore_eos": True},
        ))

    chunks = stream({"include_usage": True, "continuous_usage_stats": True})
    assert all(ch.usage is not None for ch in chunks)
    completion = [ch.usage.completion_tokens for ch in chunks]
    assert completion == sorted(completion) and completion[-1] == 12
    tokens = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason is None]
    running = [ch.usage.completion_tokens for ch in tokens]
    assert running == sorted(set(running)) and running[0] >= 1  # rises with each delta
    assert {ch.usage.prompt_tokens for ch in chunks} == {chunks[-1].usage.prompt_tokens} != {0}
    plain = stream({"continuous_usage_stats": True})
    assert all(ch.usage is None for ch in plain)


def test_completions_streaming_and_not(srv: ServerHandle) -> None:
    c = client(srv)
    r = c.completions.create(model=_model(srv), prompt="The quick brown", max_tokens=6,
                             temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=_model(srv), prompt="The quick brown", max_tokens=6,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
        if ch.choices
    )
    assert streamed == r.choices[0].text and streamed


def test_completion_token_id_prompt_and_logprobs(srv: ServerHandle) -> None:
    r: Any = client(srv).completions.create(
        model=_model(srv), prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    # Keyed by text: two tokens that decode alike (partial UTF-8) share one key.
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token in top and abs(max(top.values()) - logprob) < 1e-5
    assert "".join(lp.tokens) == r.choices[0].text


def test_chat_logprobs(srv: ServerHandle) -> None:
    r: Any = client(srv).chat.completions.create(
        model=_model(srv), messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_n_sequences_share_the_prompt_and_differ_by_seed(srv: ServerHandle) -> None:
    prompt = "Tenants share one server but never each other's cache. " * 4
    r = client(srv, "globex").completions.create(
        model=_model(srv), prompt=prompt, max_tokens=10, n=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # seeds 7, 8, 9
    assert r.usage is not None and r.usage.completion_tokens == 30
    again = client(srv, "globex").completions.create(
        model=_model(srv), prompt=prompt, max_tokens=10, n=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_cached_tokens_are_the_callers_own(srv: ServerHandle) -> None:
    page = srv.engine.page_size
    prompt = "1234567890 3.14159 2.71828 -42 +7 100% " * 6
    first = client(srv, "acme").completions.create(model=_model(srv), prompt=prompt, max_tokens=1)
    assert first.usage is not None and first.usage.prompt_tokens >= 2 * page
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    other = client(srv, "globex").completions.create(model=_model(srv), prompt=prompt, max_tokens=1)
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    mine = client(srv, "acme").completions.create(model=_model(srv), prompt=prompt, max_tokens=1)
    assert mine.usage is not None and mine.usage.prompt_tokens_details is not None
    full_pages = (first.usage.prompt_tokens // page) * page
    assert mine.usage.prompt_tokens_details.cached_tokens >= full_pages - page > 0


def test_n_sequences_map_the_first_ones_prompt_pages(srv: ServerHandle) -> None:
    """Sequences 1..n-1 are submitted after sequence 0 filled the prompt pages, and get
    them from the tenant's prefix cache instead of computing them again."""
    from service.admission.generation import Generation, admit_all
    from service.engine.types import Admitted, Request, SamplingParams, StoppingParams

    page = srv.engine.page_size
    prompt = tuple(range(10, 10 + 3 * page + 5))  # 3 full pages and a partial one
    base = Request("share-n", "acme", prompt, SamplingParams(seed=1), StoppingParams(max_tokens=4))

    async def run() -> dict[int, int]:
        leases = await admit_all(srv.server.limiter, "acme", len(prompt) + 4, 4)
        gen = Generation(srv.engine, base, leases)
        await gen.start()
        cached: dict[int, int] = {}
        try:
            async for i, event in gen.events():
                if isinstance(event, Admitted):
                    cached[i] = event.cached_tokens
        finally:
            gen.close()
        return cached

    cached = srv.call(run())
    assert cached == {0: 0, 1: 3 * page, 2: 3 * page, 3: 3 * page}
