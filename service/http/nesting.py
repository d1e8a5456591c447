"""How deeply a parsed JSON body nests, checked once after parsing.

Python's JSON reader and writer recurse: a body of 100,000 ``[`` raised ``RecursionError``
out of the handler (a 500), and a body just under the reader's limit could still overflow a
later ``json.dumps`` of a part of it. A body that parsed is walked once here, iteratively,
and one deeper than ``MAX_BODY_NESTING`` is refused, so everything after works on shallow
values. The limit sits above the structured-output schema limit, so a too-deep schema is
refused by that limit's own message.
"""

from __future__ import annotations

from typing import Any

MAX_BODY_NESTING = 200
TOO_DEEP = f"nests deeper than {MAX_BODY_NESTING} levels"


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
