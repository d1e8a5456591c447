"""Request preparation, step 3: the tokenized prompt against the limits: not empty, within
the tenant's prompt-token limit, and with ``max_tokens`` inside the model's context.
INVALID_ARGUMENT with every problem found."""

from __future__ import annotations

from service.admission.request_fields import ModelLimits
from service.errors import Violations, raise_if


def check_prompt_length(n: int, field: str, token_limit: int, out: Violations) -> None:
    if n == 0:
        out.append((field, "prompt is empty after tokenization"))
    elif n > token_limit:
        out.append((field, f"prompt has {n} tokens; the limit is {token_limit}"))


def check_context(prompt_len: int, max_tokens: int, model: ModelLimits, out: Violations) -> None:
    if max_tokens > 0 and prompt_len + max_tokens > model.max_model_len:
        out.append(
            (
                "stopping.max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the context "
                f"length {model.max_model_len}",
            )
        )


def check_limits(
    prompt_len: int, field: str, token_limit: int, max_tokens: int | None, model: ModelLimits
) -> None:
    """The prompt's length (reported on ``field``, the input) and, for a generation
    (``max_tokens`` not None), the context it leaves."""
    out: Violations = []
    check_prompt_length(prompt_len, field, token_limit, out)
    raise_if(out)
    if max_tokens is not None:
        check_context(prompt_len, max_tokens, model, out)
        raise_if(out)
