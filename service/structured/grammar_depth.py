"""How deep a grammar spec nests, measured before llguidance sees it.

llguidance walks a grammar's rule references recursively on the calling thread's stack: a
Lark chain ``start: a0``, ``a0: a1``, ... of 2,800 rules (34 KB) overflowed an 8 MiB thread
stack and killed the process, and a JSON schema's ``$ref`` chain does the same. Size limits
do not catch this (the chain is small); depth does. These functions bound the depth from the
source text alone, in linear time and without recursion:

- ``lark_depth``: the rules and terminals form a reference graph. Any recursive walk over it
  follows a simple path, and a simple path passes through each strongly connected component
  at most once and visits at most its members, so the longest path through the graph of
  components, each weighted by its members (a rule weighs one plus its bracket nesting), is
  an upper bound on the walk's depth.
- ``json_nesting``: bracket nesting of a JSON text (Python's own ``json`` parser recurses too).
- ``json_ref_depth``: the same component bound over a schema's definitions and their ``$ref``s.
- ``lark_json_schemas``: the JSON schemas a Lark grammar embeds (``%json``), each held to the
  JSON bounds above (constrained tool choices are such grammars, one schema per tool).

The compile itself still runs on a large stack (``compile_executor``) for whatever a bound
here misses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

# A Lark token: a ``%json`` directive, a string literal, a regex literal, a comment, a name, or one bracket.
_LARK_TOKEN = re.compile(
    r"(?P<json>%json\b)"
    r'|"(?:\\.|[^"\\\n])*"i?'
    r"|/(?:\\.|[^/\\\n])+/[imslux]*"
    r"|//[^\n]*"
    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<open>[(\[{])|(?P<close>[)\]}])"
)
# A definition starts a line: ``name:``, ``?name:``, ``!name:``, ``name.2:``, ``NAME.-1:``.
_LARK_DEFINITION = re.compile(r"^[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:", re.MULTILINE)


def lark_depth(source: str) -> int:
    """An upper bound on how deep a recursive walk of the Lark grammar's references goes."""
    starts = [(m.start(), m.end(), m.group(1)) for m in _LARK_DEFINITION.finditer(source)]
    graph: dict[str, set[str]] = {}
    weight: dict[str, int] = {}
    for i, (_, body_start, name) in enumerate(starts):
        body_end = starts[i + 1][0] if i + 1 < len(starts) else len(source)
        refs, nesting = _lark_body(source, body_start, body_end)
        graph.setdefault(name, set()).update(refs)
        weight[name] = max(weight.get(name, 1), 1 + nesting)
    return longest_weighted_path(graph, weight)


def _lark_body(source: str, start: int, end: int) -> tuple[set[str], int]:
    refs: set[str] = set()
    depth = deepest = 0
    for m in _LARK_TOKEN.finditer(source, start, end):
        if m.group("name") is not None:
            refs.add(m.group("name"))
        elif m.group("open") is not None:
            depth += 1
            deepest = max(deepest, depth)
        elif m.group("close") is not None:
            depth = max(0, depth - 1)
    return refs, deepest


def lark_json_schemas(source: str) -> list[tuple[int, str]]:
    """(line, text) of each JSON schema a Lark grammar embeds with ``%json {...}`` (1-based
    lines; ``%json`` inside a string literal or comment is not one), found by scanning."""
    found: list[tuple[int, str]] = []
    at = 0
    while (m := _LARK_TOKEN.search(source, at)) is not None:
        at = m.end()
        if m.group("json") is None:
            continue
        start = at
        while start < len(source) and source[start] in " \t":
            start += 1
        end = _json_value_end(source, start)
        if end is not None:
            found.append((source.count("\n", 0, m.start()) + 1, source[start:end]))
            at = end
    return found


def _bracket_depths(text: str, start: int = 0) -> Iterator[tuple[int, int]]:
    """``(index, depth after it)`` of each bracket of a JSON text from ``start``, brackets
    inside strings left out."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            yield i, depth
        elif ch in "]}":
            depth -= 1
            yield i, depth


def _json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at ``start`` ends (by its brackets), or None."""
    if start >= len(text) or text[start] not in "[{":
        return None
    return next((i + 1 for i, depth in _bracket_depths(text, start) if depth == 0), None)


def json_nesting(text: str) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings do not count)."""
    return max((depth for _, depth in _bracket_depths(text)), default=0)


_DEFINITION_KEYS = ("$defs", "definitions")


def json_ref_depth(schema: Any) -> int:
    """An upper bound on how deep a walk through a schema's ``$ref``s goes (the document and
    each entry of its top-level ``$defs``/``definitions`` is one node). Call it only on a
    value whose nesting ``json_nesting`` has bounded (this walk is iterative anyway)."""
    if not isinstance(schema, dict):
        return 1
    nodes: dict[str, Any] = {"#": {k: v for k, v in schema.items() if k not in _DEFINITION_KEYS}}
    for key in _DEFINITION_KEYS:
        defs = schema.get(key)
        if isinstance(defs, dict):
            for name, sub in defs.items():
                nodes[f"#/{key}/{name}"] = sub
    graph = {node: set(_refs(value)) for node, value in nodes.items()}
    return longest_weighted_path(graph, dict.fromkeys(graph, 1))


def _refs(value: Any) -> Iterable[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                yield ref
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_schema(text: str) -> Any:
    """``json.loads``; None when the text is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def longest_weighted_path(graph: Mapping[str, set[str]], weight: Mapping[str, int]) -> int:
    """The heaviest path through the graph's strongly connected components, each weighing
    the sum of its members' weights. Edges to names without a node are ignored."""
    components = _components(graph)
    component_of = {node: i for i, members in enumerate(components) for node in members}
    # Tarjan emits components in reverse topological order: successors come first.
    best: list[int] = []
    for i, members in enumerate(components):
        below = 0
        for node in members:
            for ref in graph[node]:
                j = component_of.get(ref)
                if j is not None and j != i:
                    below = max(below, best[j])
        best.append(sum(weight.get(node, 1) for node in members) + below)
    return max(best, default=0)


def _components(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (the graph may be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, [r for r in graph[root] if r in graph])]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                ref = pending.pop()
                if ref not in index:
                    index[ref] = low[ref] = len(index)
                    stack.append(ref)
                    on_stack.add(ref)
                    work.append((ref, [r for r in graph[ref] if r in graph]))
                elif ref in on_stack:
                    low[node] = min(low[node], index[ref])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                out.append(members)
    return out
