"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, on the gRPC ``Tokenize``
path: the same input checks (``RequestPrep.read_tokenize``), the same tokenizer pool, and
limited like it (a concurrency slot, the input charged by its size).

- ``/tokenize``: ``{"model"?, "prompt": str, "add_special_tokens"?: true}`` or
  ``{"model"?, "messages": [...], "tools"?, "add_generation_prompt"?: true}`` ->
  ``{"tokens": [...], "count": n, "max_model_len": m, "token_strs": [...] | null}``
  (``token_strs`` with ``"return_token_strs": true``);
- ``/detokenize``: ``{"model"?, "tokens": [...]}`` -> ``{"prompt": str}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from protos.kvfence.v1 import inference_pb2
from service.admission.request_fields import ModelLimits
from service.admission.tenant_adapters import UNKNOWN_MODEL, Adapters
from service.admission.tenants import Tenant
from service.errors import Violations, invalid_argument
from service.http import chat_parse
from service.http.deps import FrontDeps, body_limit
from service.http.json_route import answer_json
from service.http.parse import load_body

TOKENIZE_TEXT = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT = frozenset({"model", "messages", "tools", "add_generation_prompt",
                           "add_special_tokens", "return_token_strs"})
DETOKENIZE = frozenset({"model", "tokens"})


def _model(body: Mapping[str, Any], model: ModelLimits, adapters: tuple[str, ...],
           out: Violations) -> None:
    """The base model's names and the caller's adapters tokenize alike; others are unknown."""
    name = body.get("model")
    if name is None or name == "":
        return
    if not isinstance(name, str):
        out.append(("model", "must be a string"))
    elif model.resolve(name) != model.name and name not in adapters:
        out.append(UNKNOWN_MODEL)


def _unknown(body: Mapping[str, Any], allowed: frozenset[str], out: Violations) -> None:
    out.extend((name, "unknown or unsupported field") for name in sorted(body)
               if name not in allowed and body[name] is not None)


def _flag(body: Mapping[str, Any], name: str, default: bool, out: Violations) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        out.append((name, "must be a boolean"))
        return default
    return value


def tokenize_request(
    raw: bytes, model: ModelLimits, adapters: tuple[str, ...]
) -> tuple[inference_pb2.TokenizeRequest, bool]:
    """The body as a ``TokenizeRequest`` and whether token strings were asked for; raises
    INVALID_ARGUMENT."""
    body = load_body(raw)
    out: Violations = []
    req = inference_pb2.TokenizeRequest()
    _model(body, model, adapters, out)
    if body.get("messages") is not None:
        _unknown(body, TOKENIZE_CHAT, out)
        if not isinstance(body["messages"], list):
            out.append(("messages", "must be an array"))
        else:
            chat_parse.messages(body["messages"], req.chat, out)
            chat_parse.tools(body, req.chat, out)
            req.chat.add_generation_prompt = _flag(body, "add_generation_prompt", True, out)
            req.chat.SetInParent()
        # The chat template spells out its own special tokens.
        req.add_special_tokens = _flag(body, "add_special_tokens", False, out)
    elif isinstance(body.get("prompt"), str):
        _unknown(body, TOKENIZE_TEXT, out)
        req.text = body["prompt"]
        req.add_special_tokens = _flag(body, "add_special_tokens", True, out)
    else:
        out.append(("prompt", "send a prompt string, or messages"))
    strs = _flag(body, "return_token_strs", False, out)
    if out:
        raise invalid_argument(out)
    return req, strs


def detokenize_ids(raw: bytes, model: ModelLimits, adapters: tuple[str, ...]) -> list[int]:
    """The body's token ids, each inside the vocabulary, at most a context's worth; raises
    INVALID_ARGUMENT."""
    body = load_body(raw)
    out: Violations = []
    _model(body, model, adapters, out)
    _unknown(body, DETOKENIZE, out)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        out.append(("tokens", "must be an array of token ids"))
    elif len(ids) > model.max_model_len:
        out.append(("tokens", f"at most {model.max_model_len} token ids (the context length)"))
    elif not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model.vocab_size
                 for t in ids):
        out.append(("tokens", f"must be token ids in [0, {model.vocab_size})"))
    if out:
        raise invalid_argument(out)
    assert isinstance(ids, list)
    return ids


class TokenRoutes:
    """The two routes' handlers; ``adapters`` names the caller's adapters (they tokenize as
    the base does)."""

    def __init__(self, deps: FrontDeps, adapters: Adapters) -> None:
        self._d = deps
        self._adapters = adapters

    async def tokenize(self, request: HttpRequest) -> Response:
        async def work(tenant: Tenant, raw: bytes) -> dict[str, Any]:
            prep = self._d.prep
            req, strs = tokenize_request(raw, prep.model, self._adapters.names(tenant))
            inp = prep.read_tokenize(tenant, req)
            # Limited like gRPC Tokenize: a concurrency slot, the input charged by its size.
            lease = await self._d.limiter.admit(tenant.name, inp.cost)
            try:
                ids = await prep.tokenize(tenant, req, inp)
            finally:
                lease.release()
            return {"count": len(ids), "max_model_len": prep.model.max_model_len, "tokens": ids,
                    "token_strs": [prep.token_text(t) for t in ids] if strs else None}

        return await answer_json(self._d, request, "tokenize", work, self._limit)

    async def detokenize(self, request: HttpRequest) -> Response:
        async def work(tenant: Tenant, raw: bytes) -> dict[str, Any]:
            prep = self._d.prep
            ids = detokenize_ids(raw, prep.model, self._adapters.names(tenant))
            lease = await self._d.limiter.admit(tenant.name, len(ids))
            try:
                return {"prompt": await prep.prompts.text_of(tenant.name, ids)}
            finally:
                lease.release()

        return await answer_json(self._d, request, "detokenize", work, self._limit)

    def _limit(self, tenant: Tenant) -> tuple[int, Callable[[int], str]]:
        return body_limit(self._d, tenant)
