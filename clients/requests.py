"""Building request protos from keyword arguments (shared by Client and AsyncClient)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict

from clients.errors import ClientError
from protos.kvfence.v1 import inference_pb2

Messages = Sequence[Mapping[str, str]]  # [{"role": "user", "content": "..."}, ...]


class GenerateOptions(TypedDict, total=False):
    """Keyword options of generate / generate_text / chat. Unset means the server default."""

    model: str
    max_tokens: int
    min_tokens: int
    temperature: float  # 0 = greedy
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: int  # top-n alternatives per token
    client_request_id: str
    bypass_prefix_cache: bool


_SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)
_KNOWN = frozenset(GenerateOptions.__annotations__)


def build_generate_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Messages | None = None,
    add_generation_prompt: bool = True,
    options: GenerateOptions | None = None,
) -> inference_pb2.GenerateRequest:
    """Exactly one of prompt / token_ids / messages is the input."""
    opts: GenerateOptions = options or {}
    unknown = sorted(set(opts) - _KNOWN)
    if unknown:
        raise ClientError(f"unknown generate option(s): {', '.join(unknown)}")
    request = inference_pb2.GenerateRequest(
        logprobs=int(opts.get("logprobs", 0)),
        client_request_id=str(opts.get("client_request_id", "")),
        bypass_prefix_cache=bool(opts.get("bypass_prefix_cache", False)),
        model=str(opts.get("model", "")),
    )
    _set_input(request, prompt, token_ids, messages, add_generation_prompt)
    for name, value in opts.items():
        if name in _SAMPLING and value is not None:
            setattr(request.sampling, name, value)
    stopping = request.stopping
    max_tokens = opts.get("max_tokens")
    if max_tokens is not None:
        stopping.max_tokens = int(max_tokens)
    stopping.min_tokens = int(opts.get("min_tokens", 0))
    stopping.stop.extend(_strings(opts.get("stop", ()), "stop"))
    stopping.stop_token_ids.extend(int(t) for t in opts.get("stop_token_ids", ()))
    stopping.ignore_eos = bool(opts.get("ignore_eos", False))
    return request


def _strings(values: object, name: str) -> list[str]:
    if isinstance(values, str):
        # A bare string would otherwise become one stop string per character.
        return [values]
    if not isinstance(values, Sequence) or not all(isinstance(v, str) for v in values):
        raise ClientError(f"{name} must be a list of strings")
    return list(values)


def _set_input(
    request: inference_pb2.GenerateRequest,
    prompt: str | None,
    token_ids: Sequence[int] | None,
    messages: Messages | None,
    add_generation_prompt: bool,
) -> None:
    given = [
        n
        for n, v in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages))
        if v is not None
    ]
    if len(given) != 1:
        raise ClientError(
            "give exactly one of prompt, token_ids or messages"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.SetInParent()  # selects the oneof even for an empty list
        request.token_ids.ids.extend(int(t) for t in token_ids)
    elif messages is not None:
        request.chat.CopyFrom(chat_messages(messages, add_generation_prompt))


def chat_messages(
    messages: Messages,
    add_generation_prompt: bool = True,
) -> inference_pb2.ChatMessages:
    proto = inference_pb2.ChatMessages(add_generation_prompt=add_generation_prompt)
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ClientError(f"messages[{i}] needs string 'role' and 'content'")
        proto.messages.add(role=role, content=content)
    return proto


def build_tokenize_request(
    text: str | None = None,
    *,
    messages: Messages | None = None,
    add_special_tokens: bool = False,
    add_generation_prompt: bool = True,
) -> inference_pb2.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ClientError("give exactly one of text or messages")
    request = inference_pb2.TokenizeRequest(add_special_tokens=add_special_tokens)
    if text is not None:
        request.text = text
    else:
        assert messages is not None
        request.chat.CopyFrom(chat_messages(messages, add_generation_prompt))
    return request
