"""How many bytes one tenant's request may take, judged from its size before it is parsed.

Parsing is the one step of a request that runs before anything is charged, on the event
loop both fronts and every tenant's streams share: an 8 MiB JSON body of ``[0, 0, ...]``
took seconds to parse and walk, and a gRPC ``logit_bias`` of 700k entries a fifth of a
second to decode and sort. So each front bounds a request's bytes by what the tenant may
send, and refuses a larger one from its size alone (the ``Content-Length`` header, the
body's bytes as they arrive, the gRPC message's length), before any of it is parsed:

    limit = prompt tokens allowed x bytes per token + REQUEST_ALLOWANCE_BYTES

- *prompt tokens allowed*: the tenant's ``max_prompt_tokens``, or the model's context length
  less one (``service.admission.request_fields.prompt_token_limit``);
- *bytes per token*: ``TEXT_BYTES_PER_TOKEN`` (8) on gRPC, where text is sent as UTF-8 and a
  token id as a varint of at most 5 bytes; three times that (24) on HTTP, because JSON
  escapes text (``\\u00e9`` is 6 bytes for a character of 2) and a token id is written
  with its separator (``151643, `` is 8 bytes);
- ``REQUEST_ALLOWANCE_BYTES`` (256 KiB): everything else a request carries: tool schemas
  (at most 64 KiB), a grammar or JSON schema, stop strings, ``logit_bias`` (at most 1,024
  entries), message framing.

Neither limit exceeds the front's own cap (gRPC's ``max_message_bytes``, HTTP's
``MAX_BODY_BYTES``), which still applies to a caller whose tenant is not known from its
headers (a client certificate without an API key). A request within the limit can still be
refused by the field checks that follow; one past it is refused with INVALID_ARGUMENT on the
``request`` field (gRPC) or 413 naming ``body`` (HTTP), without being read further.
"""

from __future__ import annotations

from service.admission.request_fields import TEXT_BYTES_PER_TOKEN

REQUEST_ALLOWANCE_BYTES = 256 * 1024
GRPC_BYTES_PER_TOKEN = TEXT_BYTES_PER_TOKEN
JSON_BYTES_PER_TOKEN = 3 * TEXT_BYTES_PER_TOKEN


def request_limit(prompt_tokens: int, bytes_per_token: int, cap: int) -> int:
    """The most bytes of a request whose prompt may have ``prompt_tokens`` tokens."""
    return min(cap, prompt_tokens * bytes_per_token + REQUEST_ALLOWANCE_BYTES)


def too_large(size: int, limit: int, prompt_tokens: int, bytes_per_token: int) -> str:
    """The violation's description: the limit and how it is made up."""
    return (
        f"is {size} bytes, more than the {limit} bytes this tenant's requests may take "
        f"({prompt_tokens} prompt tokens x {bytes_per_token} bytes + "
        f"{REQUEST_ALLOWANCE_BYTES} bytes for the other fields)"
    )
