"""The HTTP load generator: ``run_grpc``'s twin over the OpenAI front, streaming
``/v1/completions`` through the official SDK (``AsyncOpenAI``). ``bench.online_http`` drives it
in process for warm-ups and ``bench.front_load`` in a client process of its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from bench.common import Work
from bench.kvfence_runner import drive
from bench.traces import RequestTrace


async def run_http(
    base_url: str,
    api_keys: Mapping[str, str],
    work: Sequence[Work],
    tenants: Sequence[str],
    *,
    model: str,
    arrivals: Sequence[float] | None = None,
    max_concurrency: int | None = None,
    response_format: Mapping[str, Any] | None = None,
    extra_body: Mapping[str, Any] | None = None,
) -> tuple[float, list[RequestTrace]]:
    """``run_grpc``'s twin over HTTP: streaming ``/v1/completions`` through ``AsyncOpenAI``.
    ``extra_body``: more request fields (bench.llama_server sends llama-server's own).
    A request's output tokens are the server's final ``usage.completion_tokens`` (or
    llama-server's ``timings.predicted_n``) where it reports one, else its chunks: a server may hold back a token whose text ends inside a
    UTF-8 character and send it in the next chunk (llama-server does)."""
    import openai

    clients = {t: openai.AsyncOpenAI(base_url=base_url, api_key=api_keys[t], max_retries=0,
                                     timeout=600) for t in tenants}
    extra: dict[str, Any] = {"ignore_eos": True, **(extra_body or {})}
    if response_format is not None:
        extra["response_format"] = dict(response_format)

    async def one(i: int) -> RequestTrace:
        w = work[i]
        trace = RequestTrace(tenants[i % len(tenants)], len(w.prompt_ids), time.perf_counter())
        stream = await clients[trace.tenant].completions.create(
            model=model, prompt=list(w.prompt_ids), max_tokens=w.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra,
        )
        reported: int | None = None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.finish_reason is None or choice.text:
                    trace.on_chunk(now, 1)  # one chunk per generated token, or a held-back few
                if choice.finish_reason is not None:
                    trace.end = now
                    trace.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                reported = chunk.usage.completion_tokens
                if chunk.usage.prompt_tokens_details is not None:
                    trace.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens or 0
            elif isinstance(timings := (chunk.model_extra or {}).get("timings"), dict):
                # llama-server's own figures on its last chunk, where it sends no usage
                reported = int(timings.get("predicted_n", trace.output_tokens))
        if reported is not None:
            trace.output_tokens = reported
        return trace

    try:
        return await drive(len(work), one, arrivals, max_concurrency)
    finally:
        for client in clients.values():
            await client.close()
