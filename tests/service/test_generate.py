"""Generate, Tokenize and ListModels end to end against a real server and the real engine."""

from __future__ import annotations

from protos.kvfence.v1 import cache_pb2, inference_pb2
from tests.serverutil import ServerHandle
from tests.service.rpc import generate, request, stubs, usage

PREFIX_TEXT = "The quick brown fox jumps over the lazy dog. " * 4


def _kinds(responses: list[inference_pb2.GenerateResponse]) -> list[str]:
    return [r.WhichOneof("event") for r in responses]


def test_text_generation_streams_started_chunks_finished(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    tokens = inference.Tokenize(
        inference_pb2.TokenizeRequest(text="Hello world", add_special_tokens=True),
        metadata=srv.auth("acme"),
    )
    out = generate(srv, "acme", request("Hello world", max_tokens=5, client_request_id="c-1"))
    assert _kinds(out) == ["started"] + ["chunk"] * 5 + ["finished"]
    started, finished = out[0].started, out[-1].finished
    assert len(started.request_id) == 32 and started.client_request_id == "c-1"
    assert started.prompt_tokens == len(tokens.token_ids) > 0
    assert started.model == srv.stack.model.name
    chunks = [r.chunk for r in out[1:-1]]
    assert all(len(c.token_ids) == 1 for c in chunks)
    assert finished.reason == inference_pb2.FINISH_REASON_LENGTH
    assert finished.usage.prompt_tokens == started.prompt_tokens
    assert finished.usage.completion_tokens == 5
    assert finished.timings.total_seconds >= finished.timings.ttft_seconds > 0


def test_token_id_input_matches_text_input_under_greedy(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    ids = list(
        inference.Tokenize(
            inference_pb2.TokenizeRequest(text="Hello world", add_special_tokens=True),
            metadata=srv.auth("acme"),
        ).token_ids
    )
    by_text = generate(srv, "acme", request("Hello world", max_tokens=6))
    by_ids = generate(srv, "acme", request(ids=ids, max_tokens=6))
    text_tokens = [t for r in by_text[1:-1] for t in r.chunk.token_ids]
    id_tokens = [t for r in by_ids[1:-1] for t in r.chunk.token_ids]
    assert by_ids[0].started.prompt_tokens == len(ids)
    assert text_tokens == id_tokens and len(text_tokens) == 6


def test_chat_input_is_rendered_with_the_chat_template(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    chat = inference_pb2.ChatMessages(
        messages=[
            inference_pb2.ChatMessage(role="system", content="Be brief."),
            inference_pb2.ChatMessage(role="user", content="Hello there"),
        ]
    )
    template = srv.stack.model.chat_template
    assert template is not None
    rendered = template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        True,
    )
    expected = srv.stack.model.tokenizer.encode(rendered, False)
    tokenized = inference.Tokenize(
        inference_pb2.TokenizeRequest(chat=chat), metadata=srv.auth("acme")
    )
    assert list(tokenized.token_ids) == expected
    req = request(None, max_tokens=3)
    req.chat.CopyFrom(chat)
    out = generate(srv, "acme", req)
    assert out[0].started.prompt_tokens == len(expected)
    assert out[-1].finished.usage.completion_tokens == 3


def test_cached_prompt_tokens_come_only_from_the_callers_own_tenant(srv: ServerHandle) -> None:
    first = generate(srv, "acme", request(PREFIX_TEXT, max_tokens=2))
    again = generate(srv, "acme", request(PREFIX_TEXT, max_tokens=2))
    other = generate(srv, "globex", request(PREFIX_TEXT, max_tokens=2))
    prompt = first[0].started.prompt_tokens
    assert prompt > 2 * 16
    assert first[0].started.cached_prompt_tokens == 0
    # Full pages of the prompt are reused, keeping at least one token to compute.
    assert again[0].started.cached_prompt_tokens == ((prompt - 1) // 16) * 16
    assert again[-1].finished.usage.cached_prompt_tokens == again[0].started.cached_prompt_tokens
    assert other[0].started.cached_prompt_tokens == 0
    bypass = generate(srv, "acme", request(PREFIX_TEXT, max_tokens=2, bypass_prefix_cache=True))
    assert bypass[0].started.cached_prompt_tokens == 0


def test_logprobs_carry_top_n_with_token_text(srv: ServerHandle) -> None:
    out = generate(srv, "acme", request("Hello", max_tokens=2, logprobs=3))
    for r in out[1:-1]:
        (lp,) = r.chunk.logprobs
        assert lp.token_id == r.chunk.token_ids[0]
        assert len(lp.top) == 3
        assert lp.logprob <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert lp.top[0].token_id == lp.token_id
        assert lp.top[0].token == srv.stack.model.tokenizer.id_to_token_bytes(lp.token_id).decode(
            "utf-8", "replace"
        )


def test_tokenize_returns_ids_and_token_strings(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    resp = inference.Tokenize(
        inference_pb2.TokenizeRequest(text="Hello world"), metadata=srv.auth("acme")
    )
    assert list(resp.token_ids) == srv.stack.model.tokenizer.encode("Hello world", False)
    assert "".join(resp.tokens) == "Hello world"


def test_list_models_respects_the_tenant_model_list(srv: ServerHandle) -> None:
    inference, _ = stubs(srv)
    (info,) = inference.ListModels(
        inference_pb2.ListModelsRequest(), metadata=srv.auth("acme")
    ).models
    cfg = srv.stack.model.model.config
    assert (info.name, info.architecture, info.max_model_len, info.vocab_size, info.dtype) == (
        srv.stack.model.name,
        "llama",
        512,
        cfg.vocab_size,
        "float32",
    )
    hidden = inference.ListModels(
        inference_pb2.ListModelsRequest(), metadata=srv.auth("other_model")
    )
    assert list(hidden.models) == []


def test_get_usage_and_purge_touch_only_the_callers_namespace(srv: ServerHandle) -> None:
    text = "Tenants share one server but never each other's cache. " * 3
    generate(srv, "acme", request(text, max_tokens=1))
    generate(srv, "acme", request(text, max_tokens=1))
    generate(srv, "globex", request(text, max_tokens=1))
    acme, globex = usage(srv, "acme"), usage(srv, "globex")
    assert acme.pages_in_use == 0 and acme.pages_cached >= 2 and acme.cached_prefixes >= 2
    assert acme.prefix_hit_tokens > 0
    assert acme.hit_rate == acme.prefix_hit_tokens / (
        acme.prefix_hit_tokens + acme.prefix_miss_tokens
    )
    assert (acme.page_size, acme.running_requests) == (16, 0)
    assert (acme.quotas.max_concurrent_streams, acme.quotas.prefix_cache_ttl_seconds) == (16, 600.0)
    _, cache = stubs(srv)
    purged = cache.Purge(cache_pb2.PurgeRequest(), metadata=srv.auth("acme"))
    assert purged.pages_purged == acme.pages_cached
    assert usage(srv, "acme").pages_cached == 0
    assert usage(srv, "globex").pages_cached == globex.pages_cached  # untouched
    again = generate(srv, "acme", request(text, max_tokens=1))
    assert again[0].started.cached_prompt_tokens == 0
    quota = usage(srv, "two_pages").quotas
    assert (quota.max_kv_pages, quota.tokens_per_minute) == (2, 0)
