"""The engine's request invariants, checked when a request is added.

The service validates every request first (``service/validation.py``, which turns problems
into BadRequest details); these checks guard the engine's own assumptions for every caller
(tests, bench, warm-up) and share their limits with the service (``MAX_LOGPROBS``).
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
    """Raise InvalidRequest / RequestTooLarge; return max_tokens capped by max_model_len."""
    if not request.request_id:
        raise InvalidRequest("request_id must not be empty")
    if not request.tenant:
        raise InvalidRequest("tenant must not be empty")
    if request.tenant.startswith(RESERVED_TENANT_PREFIX) and not internal:
        raise InvalidRequest("tenant name is reserved")
    if not request.prompt_ids:
        raise InvalidRequest("prompt must contain at least one token")
    if any(not 0 <= t < vocab_size for t in request.prompt_ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in request.stopping.stop_token_ids):
        raise InvalidRequest(f"stop token ids must be in [0, {vocab_size})")
    if not 0 <= request.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]")
    _check_sampling(request)
    stopping = request.stopping
    if stopping.max_tokens < 1:
        raise InvalidRequest("max_tokens must be >= 1")
    if not 0 <= stopping.min_tokens <= stopping.max_tokens:
        raise InvalidRequest("min_tokens must be in [0, max_tokens]")
    if any(not s for s in stopping.stop):
        raise InvalidRequest("stop strings must not be empty")
    room = config.max_model_len - len(request.prompt_ids)
    if room < 1:
        raise RequestTooLarge(
            len(request.prompt_ids) + 1, config.max_model_len, "max_model_len (tokens)"
        )
    return min(stopping.max_tokens, room)


def _check_sampling(request: Request) -> None:
    s = request.sampling
    values = (
        s.temperature,
        s.top_p,
        s.min_p,
        s.repetition_penalty,
        s.presence_penalty,
        s.frequency_penalty,
    )
    if not all(math.isfinite(v) for v in values):
        raise InvalidRequest("sampling parameters must be finite")
    if s.temperature < 0:
        raise InvalidRequest("temperature must be >= 0")
    if s.top_k < 0:
        raise InvalidRequest("top_k must be >= 0")
    if not 0 < s.top_p <= 1:
        raise InvalidRequest("top_p must be in (0, 1]")
    if not 0 <= s.min_p <= 1:
        raise InvalidRequest("min_p must be in [0, 1]")
    if s.repetition_penalty <= 0:
        raise InvalidRequest("repetition_penalty must be > 0")
