"""JSON a client sends, read the same way on both fronts: nesting bounded, text checked.

Python's JSON reader and writer recurse: a body of 100,000 ``[`` raised ``RecursionError``
(a 500 on HTTP, INTERNAL on gRPC), and a value just under the reader's limit could still
overflow a later ``json.dumps`` of a part of it. ``load`` reads a JSON text and walks the
value once, iteratively, refusing one deeper than ``MAX_NESTING``, so everything after works
on shallow values. The HTTP front reads its body with it; the JSON text fields of a chat
(a tool's ``parameters``, a call's ``arguments``), which gRPC carries as strings, are read
with it too. The limit sits above the structured-output schema limit, so a too-deep schema
is refused by that limit's own message.

JSON may also spell a lone UTF-16 surrogate (``"\\ud800"``), which is no Unicode text:
it cannot be encoded as UTF-8, so it can reach neither a protobuf string nor the tokenizer.
``lone_surrogate`` finds the first such string (a protobuf message parsed from the wire
cannot hold one: its strings are UTF-8 checked by the parser).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_NESTING = 200
TOO_DEEP = f"nests deeper than {MAX_NESTING} levels"
NOT_TEXT = "is not valid Unicode text (it holds a lone surrogate, \\ud800-\\udfff)"
# Only a \u escape can put a surrogate in a parsed string (raw surrogate bytes are not UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_$-]{1,64}$")
#: Fields whose value is JSON the client wrote (a schema, arguments, a map): paths stop there.
FREE_FORM = frozenset({"parameters", "arguments", "schema", "logit_bias", "metadata"})


class JsonInputError(ValueError):
    """The text is not JSON, or nests too deep; the message is the reason (no input text)."""


def load(text: str | bytes) -> Any:
    """The parsed value; ``JsonInputError`` when it is not JSON or nests deeper than
    ``MAX_NESTING``."""
    try:
        value = json.loads(text)
    except RecursionError:  # deeper than Python's reader goes
        raise JsonInputError(TOO_DEEP) from None
    except ValueError:  # UnicodeDecodeError is one
        raise JsonInputError("is not valid JSON") from None
    if nesting(value) > MAX_NESTING:
        raise JsonInputError(TOO_DEEP)
    return value


def nesting(value: Any) -> int:
    """The deepest container nesting of a parsed JSON value (a scalar is 0)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            items: Any = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in items)
    return deepest


def may_hold_surrogate(raw: bytes) -> bool:
    """False when a JSON text cannot parse to a string with a lone surrogate (linear, C)."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def lone_surrogate(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string or key of a parsed JSON
    value that holds a lone surrogate ("" for the value itself), or None. The path stops at
    a field whose value is the client's own JSON (``FREE_FORM``: a schema's property names
    or a call's argument names are the client's text, and errors carry none) and at a key
    that does not look like a field name."""
    stack: list[tuple[Any, str, bool]] = [(value, "", True)]
    while stack:
        item, path, named = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _SURROGATE.search(key):
                    return path
                extend = named and _PLAIN_KEY.match(key) is not None
                sub = (f"{path}.{key}" if path else key) if extend else path
                stack.append((child, sub, extend and key not in FREE_FORM))
        elif isinstance(item, list):
            stack.extend(
                (child, f"{path}[{i}]" if named else path, named)
                for i, child in reversed(list(enumerate(item)))
            )
    return None
