"""Which OpenAI request fields the HTTP front honours, accepts and ignores, or refuses.

The lists follow what the official ``openai`` SDKs and the common gateways and agent
frameworks (LiteLLM, LangChain, the Vercel AI SDK, the OpenAI Agents SDK) put in a body.
A field that changes the output and that kvfence cannot honour is refused by name (400,
``param`` = the field), never silently dropped; a field that only carries bookkeeping for
OpenAI's own platform is accepted and ignored. A field on none of the lists is refused as
unknown. docs/openai.md is the user-facing copy of these lists.

A JSON ``null`` is treated as an absent field everywhere (gateways send explicit nulls).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.errors import Violations

COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "response_format",
        "min_tokens",
        "ignore_eos",
        "logit_bias",
        "user",  # logged as a hashed end-user id
        "safety_identifier",  # OpenAI's newer name for ``user``: the same
        "cache_salt",
    }
)
CHAT = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
COMPLETION = COMMON | {"prompt", "logprobs", "echo", "best_of"}

#: Accepted and ignored: bookkeeping for OpenAI's platform that changes no output here.
IGNORED: Mapping[str, str] = {
    "store": "kvfence stores no completions",
    "metadata": "only meaningful with store",
    "service_tier": "one tier; the tenant's limits apply",
    "prompt_cache_key": "the prefix cache is keyed by tenant (and cache_salt), not routed",
    "prompt_cache_retention": "cache lifetime is the tenant's TTL",
    "reasoning_effort": "the served model has no reasoning budget",
    "verbosity": "the served model has no verbosity control",
}

#: Refused by name, with the reason in the error message.
REFUSED: Mapping[str, str] = {
    "functions": "is deprecated by OpenAI; send tools",
    "function_call": "is deprecated by OpenAI; send tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "suffix": "is not supported",
}


def check_names(body: Mapping[str, Any], allowed: frozenset[str], out: Violations) -> None:
    """Record a violation for each refused or unknown field of ``body``."""
    for name in sorted(body):
        value = body[name]
        if name in allowed or name in IGNORED or value is None:
            continue
        if name == "modalities":
            if value != ["text"]:
                out.append((name, 'only ["text"] is supported'))
        elif name in REFUSED:
            out.append((name, REFUSED[name]))
        else:
            out.append((name, "unknown or unsupported field"))
