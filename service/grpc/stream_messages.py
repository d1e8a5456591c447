"""Engine events -> ``GenerateResponse`` messages (pure functions)."""

from __future__ import annotations

from collections.abc import Callable

from protos.kvfence.v1 import inference_pb2
from service.engine.types import Admitted, Delta, Finished
from service.structured.tool_calls import ParsedCall

FINISH_REASONS = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
}


def started(
    event: Admitted, request_id: str, client_request_id: str, model: str
) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        started=inference_pb2.Started(
            request_id=request_id,
            client_request_id=client_request_id,
            prompt_tokens=event.prompt_tokens,
            cached_prompt_tokens=event.cached_tokens,
            model=model,
        )
    )


def chunk(event: Delta, token_text: Callable[[int], str]) -> inference_pb2.GenerateResponse:
    msg = inference_pb2.Chunk(token_ids=event.token_ids, text=event.text)
    for lp in event.logprobs:
        msg.logprobs.append(
            inference_pb2.TokenLogprobs(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top=[
                    inference_pb2.TopLogprob(token_id=t, logprob=p, token=token_text(t))
                    for t, p in lp.top
                ],
            )
        )
    return inference_pb2.GenerateResponse(chunk=msg)


def tool_calls(calls: tuple[ParsedCall, ...]) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        tool_calls=inference_pb2.ToolCalls(
            calls=[inference_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                   for c in calls]
        )
    )


def finished(event: Finished, called: bool = False) -> inference_pb2.GenerateResponse:
    """The ``finished`` message of a normal stop (``stop`` or ``length``); a stop after
    tool calls is ``TOOL_CALLS``."""
    reason = FINISH_REASONS[event.reason]
    if called and event.reason == "stop":
        reason = inference_pb2.FINISH_REASON_TOOL_CALLS
    return inference_pb2.GenerateResponse(
        finished=inference_pb2.Finished(
            reason=reason,
            usage=inference_pb2.Usage(
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                cached_prompt_tokens=event.cached_tokens,
            ),
            timings=inference_pb2.Timings(
                queue_seconds=event.queue_s,
                ttft_seconds=event.ttft_s or 0.0,
                total_seconds=event.total_s,
            ),
        )
    )
