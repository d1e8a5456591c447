"""Searching logs and errors for request content the way a reader would see it.

Log lines are JSON: a non-ASCII secret appears there only as ``\\uXXXX`` escapes, so raw
substring search can never find it. ``log_strings`` decodes every line and returns every
string in it (keys and values, nested), and ``leaked`` searches those for each fragment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

# Non-ASCII on purpose (JSON escapes it), with ASCII words a sloppy search would find.
SECRET = "zebra-secret-4417 ünïcødé 秘密の鍵 please keep"
SECRET_FRAGMENTS = ("zebra-secret-4417", "ünïcødé", "秘密の鍵")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def log_strings(lines: Iterable[str]) -> list[str]:
    """Every string in every JSON log line, decoded (a line that is not JSON counts whole)."""
    out: list[str] = []
    for line in lines:
        try:
            out.extend(_strings(json.loads(line)))
        except json.JSONDecodeError:
            out.append(line)
    return out


def leaked(haystacks: Iterable[str], needles: Iterable[str]) -> list[tuple[str, str]]:
    """(needle, haystack) for every needle found; empty needles are a test bug."""
    needles = list(needles)
    assert needles and all(needles), "nothing to search for"
    return [(n, h[:200]) for h in haystacks for n in needles if n in h]
