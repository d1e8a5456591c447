"""A renderer for the small part of Helm's template language deploy/helm/kvfence uses, for
checking the chart where `helm` is not installed: ``{{ .Values.a.b }}``, ``.Release.Name``,
``.Chart.Name``, ``if``/``else``/``end`` (``not`` allowed), and the pipes ``quote``,
``toYaml``, ``indent N`` and ``nindent N``, with Go's ``{{-``/``-}}`` whitespace trimming.
Anything else raises, so a template cannot use a construct this check does not understand."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import yaml

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


class UnsupportedTemplate(ValueError):
    pass


def render(text: str, values: Mapping[str, Any], release: str, chart: Mapping[str, Any]) -> str:
    pieces: list[str] = []  # even indices text, odd indices actions
    pos = 0
    trim_next = False
    for m in _ACTION.finditer(text):
        literal = text[pos:m.start()]
        literal = literal.lstrip() if trim_next else literal
        pieces += [literal.rstrip() if m.group(1) else literal, m.group(2)]
        trim_next, pos = bool(m.group(3)), m.end()
    pieces.append(text[pos:].lstrip() if trim_next else text[pos:])
    scope = {"Values": values, "Release": {"Name": release}, "Chart": chart}
    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (enclosing block active, this branch taken)
    active = True
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if active:
                out.append(piece)
        elif piece.startswith("if "):
            taken = _truthy(_pipeline(piece[3:], scope))
            stack.append((active, taken))
            active = active and taken
        elif piece == "else":
            enclosing, taken = stack[-1]
            active = enclosing and not taken
        elif piece == "end":
            active = stack.pop()[0]
        elif active:
            out.append(_text(_pipeline(piece, scope)))
    if stack:
        raise UnsupportedTemplate("unclosed if")
    return "".join(out)


def _pipeline(expr: str, scope: Mapping[str, Any]) -> Any:
    stages = [s.strip() for s in expr.split("|")]
    words = stages[0].split()
    value = _ref(words[-1], scope)
    for fn in reversed(words[:-1]):
        value = _apply(fn, [], value)
    for stage in stages[1:]:
        fn, *args = stage.split()
        value = _apply(fn, args, value)
    return value


def _ref(path: str, scope: Mapping[str, Any]) -> Any:
    if not path.startswith("."):
        raise UnsupportedTemplate(f"not a value reference: {path}")
    value: Any = scope
    for key in path[1:].split("."):
        value = value[key]
    return value


def _apply(fn: str, args: list[str], value: Any) -> Any:
    if fn == "quote" and not args:
        return json.dumps(_text(value))
    if fn == "not" and not args:
        return not _truthy(value)
    if fn == "toYaml" and not args:
        return yaml.safe_dump(value, default_flow_style=False).rstrip("\n")
    if fn in ("indent", "nindent") and len(args) == 1:
        pad = " " * int(args[0])
        indented = pad + _text(value).replace("\n", "\n" + pad)
        return "\n" + indented if fn == "nindent" else indented
    raise UnsupportedTemplate(f"{fn} {args}")


def _truthy(value: Any) -> bool:
    return value not in (None, False, 0, "") and value != [] and value != {}


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise UnsupportedTemplate(f"cannot print {type(value).__name__} without toYaml")
