"""Requests and streams over gRPC, read into plain results.

``collect`` (blocking stub) and ``collect_async`` (``grpc.aio``) read a whole Generate stream
into a ``StreamResult``: the Started message, every chunk's token ids and text, the Finished
message, the final status code, and client-side timestamps (TTFT, inter-chunk gaps).
``check_stream`` lists everything wrong with a stream's shape: one Started first, exactly
one Finished last, chunk token counts that agree with usage.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.kvfence.v1 import inference_pb2

Metadata = tuple[tuple[str, str], ...]


def gen_request(
    ids: Sequence[int] | None = None,
    *,
    text: str | None = None,
    max_tokens: int = 8,
    temperature: float = 0.0,
    logprobs: int = 0,
    client_request_id: str = "",
    ignore_eos: bool = True,
) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(
        sampling=inference_pb2.SamplingParams(temperature=temperature),
        stopping=inference_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        logprobs=logprobs,
        client_request_id=client_request_id,
    )
    if ids is not None:
        req.token_ids.ids.extend(ids)
    elif text is not None:
        req.text = text
    return req


def bearer(key: str) -> Metadata:
    return (("authorization", f"Bearer {key}"),)


@dataclass(slots=True)
class StreamResult:
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    started: inference_pb2.Started | None = None
    finished: inference_pb2.Finished | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    # per chunk: (token ids, top-2 logprob gap of the chosen token, or None)
    gaps: list[float | None] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # "started" | "chunk" | "finished", in order
    t_start: float = 0.0
    t_first_chunk: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    t_end: float = 0.0
    trailing: Any = None

    @property
    def ok(self) -> bool:
        return bool(self.code == grpc.StatusCode.OK)

    @property
    def ttft(self) -> float | None:
        return None if self.t_first_chunk is None else self.t_first_chunk - self.t_start

    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    def add(self, response: inference_pb2.GenerateResponse, now: float) -> None:
        kind = response.WhichOneof("event")
        self.events.append(str(kind))
        if kind == "started":
            self.started = response.started
        elif kind == "chunk":
            if self.t_first_chunk is None:
                self.t_first_chunk = now
            self.chunk_times.append(now)
            self.tokens.extend(response.chunk.token_ids)
            self.text += response.chunk.text
            for lp in response.chunk.logprobs:
                tops = sorted((t.logprob for t in lp.top), reverse=True)
                self.gaps.append(tops[0] - tops[1] if len(tops) >= 2 else None)
        elif kind == "finished":
            self.finished = response.finished


def collect(call: Iterable[inference_pb2.GenerateResponse]) -> StreamResult:
    """Read a blocking Generate call to its end (the call must just have been made)."""
    out = StreamResult(t_start=time.monotonic())
    try:
        for response in call:
            out.add(response, time.monotonic())
    except grpc.RpcError as err:
        out.code = err.code()
        out.details = err.details() or ""
    out.t_end = time.monotonic()
    return out


async def collect_async(call: Any, t_start: float | None = None) -> StreamResult:
    """Read a ``grpc.aio`` unary-stream call to its end with ``read()`` (so a caller may
    have read its first messages already; gRPC forbids mixing ``read`` and iteration)."""
    out = StreamResult(t_start=time.monotonic() if t_start is None else t_start)
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            out.add(response, time.monotonic())
    except grpc.RpcError as err:
        out.code = err.code()
        out.details = err.details() or ""
    out.t_end = time.monotonic()
    return out


def check_stream(result: StreamResult, *, prompt_tokens: int, max_tokens: int) -> list[str]:
    """Problems with an OK stream that ran to ``max_tokens`` (``ignore_eos``): an empty list
    means one Started first, one Finished last, and tokens == usage == max_tokens."""
    problems: list[str] = []
    if not result.ok:
        return [f"status {result.code.name}"]
    if not result.events or result.events[0] != "started" or result.events.count("started") != 1:
        problems.append("not exactly one Started, first")
    if result.events.count("finished") != 1 or result.events[-1] != "finished":
        problems.append("not exactly one Finished, last")
    fin = result.finished
    if fin is None:
        return problems
    if fin.reason != inference_pb2.FINISH_REASON_LENGTH:
        problems.append(f"finish reason {fin.reason}")
    if fin.usage.completion_tokens != len(result.tokens):
        problems.append(f"usage {fin.usage.completion_tokens} != {len(result.tokens)} streamed")
    if len(result.tokens) != max_tokens:
        problems.append(f"{len(result.tokens)} tokens, asked {max_tokens}")
    if fin.usage.prompt_tokens != prompt_tokens:
        problems.append(f"prompt_tokens {fin.usage.prompt_tokens} != {prompt_tokens}")
    if result.started is not None and result.started.prompt_tokens != prompt_tokens:
        problems.append("started.prompt_tokens disagrees")
    return problems
