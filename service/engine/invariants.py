"""The engine's request invariants, checked when a request is added.

The service prepares every request first (``service/admission/``: each field parsed and
checked once, problems turned into BadRequest details); the engine trusts what it is given,
and the field rules below are assertions of that contract, not a second validator. What
only the engine can know stays a typed refusal: a reserved tenant name outside the engine's
own work (``InvalidRequest``) and a prompt that leaves no room in the context
(``RequestTooLarge``). ``MAX_LOGPROBS`` is shared with the service.
"""

from __future__ import annotations

import math

from service.engine.types import (
    RESERVED_TENANT_PREFIX,
    EngineConfig,
    InvalidRequest,
    Request,
    RequestTooLarge,
)

MAX_LOGPROBS = 20


def validate_request(
    request: Request, config: EngineConfig, vocab_size: int, internal: bool = False
) -> int:
    """Raise InvalidRequest / RequestTooLarge; return max_tokens capped by max_model_len.
    A request that breaks the service's contract fails an assertion."""
    assert request.request_id and request.tenant, "request_id and tenant are set"
    if request.tenant.startswith(RESERVED_TENANT_PREFIX) and not internal:
        raise InvalidRequest("tenant name is reserved")
    assert request.prompt_ids, "prompt has at least one token"
    assert all(0 <= t < vocab_size for t in request.prompt_ids), "prompt ids in the vocabulary"
    stopping = request.stopping
    assert all(0 <= t < vocab_size for t in stopping.stop_token_ids), "stop ids in the vocabulary"
    assert 0 <= request.logprobs <= MAX_LOGPROBS, "logprobs in [0, MAX_LOGPROBS]"
    s = request.sampling
    values = (s.temperature, s.top_p, s.min_p, s.repetition_penalty, s.presence_penalty,
              s.frequency_penalty)
    assert all(math.isfinite(v) for v in values), "sampling parameters are finite"
    assert s.temperature >= 0 and s.top_k >= 0, "temperature and top_k >= 0"
    assert 0 < s.top_p <= 1 and 0 <= s.min_p <= 1, "top_p in (0, 1], min_p in [0, 1]"
    assert s.repetition_penalty > 0, "repetition_penalty > 0"
    assert stopping.max_tokens >= 1, "max_tokens >= 1"
    assert 0 <= stopping.min_tokens <= stopping.max_tokens, "min_tokens in [0, max_tokens]"
    assert all(stopping.stop), "stop strings are not empty"
    room = config.max_model_len - len(request.prompt_ids)
    if room < 1:
        raise RequestTooLarge(
            len(request.prompt_ids) + 1, config.max_model_len, "max_model_len (tokens)"
        )
    return min(stopping.max_tokens, room)
