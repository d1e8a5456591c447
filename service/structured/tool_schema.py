"""The schema a constrained tool call (``tool_choice`` required or a named function) is
compiled with: the tool's own schema, closed the way OpenAI's ``strict`` function calling
reads schemas, so the call always ends.

JSON Schema lets an object without ``additionalProperties`` carry any other key. A grammar
built from that lets a model add keys until ``max_tokens`` (the call never closes: no tool
call, finish ``length``). So, for the constrained call only:

- an object schema that defines its own keys and says nothing of ``additionalProperties``
  gets ``additionalProperties: false`` (OpenAI's strict semantics; Pydantic writes no
  ``additionalProperties`` unless a model sets ``extra``);
- where a schema allows extra keys explicitly (``additionalProperties`` true or a schema,
  or ``patternProperties``), they stay allowed but counted: at most
  ``MAX_EXTRA_PROPERTIES`` beyond the declared ones (``maxProperties``, lowered, never
  raised). llguidance counts keys only where every declared key is required; an object
  with optional keys and explicit extras is compiled without the extras (a call without
  them is still valid against the schema);
- a string without ``maxLength`` is held to ``MAX_STRING_CHARS`` characters (or its
  ``minLength``, if larger): a small model can loop inside a string value (the default
  SmolLM2-135M wrote ``"2019_2019_..."`` until ``max_tokens`` for one of twenty greedy
  requests), and a call whose string never closes is no call. A schema that needs longer
  strings says so with ``maxLength``.

An object schema that composes others (``$ref``, ``allOf``, ``anyOf``, ``oneOf`` beside its
own keys) is left as written: closing it would refuse the keys its parts declare. The parts
themselves are closed where they are visited. The schema the model is shown (the prompt) is
the client's, unchanged.
"""

from __future__ import annotations

from typing import Any

#: Keys an object with explicitly allowed extras may carry beyond its declared properties.
MAX_EXTRA_PROPERTIES = 8
#: Characters a string value without its own ``maxLength`` may hold in a constrained call.
MAX_STRING_CHARS = 256

_COMPOSED = ("$ref", "allOf", "anyOf", "oneOf")
# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
        "unevaluatedProperties", "propertyNames")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` with every object closed or bounded as the module says. Walks
    with an explicit stack (the schema's nesting was bounded by ``check_tools``, but the
    walk need not recurse)."""
    root = dict(schema)
    stack: list[dict[str, Any]] = [root]
    while stack:
        node = stack.pop()
        _close_object(node)
        _bound_string(node)
        for key in _ONE:
            if isinstance(node.get(key), dict):
                node[key] = dict(node[key])
                stack.append(node[key])
        for key in _LIST:
            if isinstance(node.get(key), list):
                node[key] = [dict(s) if isinstance(s, dict) else s for s in node[key]]
                stack.extend(s for s in node[key] if isinstance(s, dict))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                node[key] = {k: dict(s) if isinstance(s, dict) else s for k, s in node[key].items()}
                stack.extend(s for s in node[key].values() if isinstance(s, dict))
    return root


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and "properties" in node


def _bound_string(node: dict[str, Any]) -> None:
    kind = node.get("type")
    if (kind == "string" or (isinstance(kind, list) and "string" in kind)) \
            and "maxLength" not in node:
        least = node.get("minLength")
        node["maxLength"] = max(MAX_STRING_CHARS, least if isinstance(least, int) else 0)


def _close_object(node: dict[str, Any]) -> None:
    if not _is_object(node) or any(key in node for key in _COMPOSED):
        return
    extra = node.get("additionalProperties")
    if extra is None and "patternProperties" not in node:
        node["additionalProperties"] = False
        return
    if extra is False and "patternProperties" not in node:
        return
    properties = node.get("properties")
    declared = properties if isinstance(properties, dict) else {}
    required = node.get("required")
    if set(declared) <= set(required if isinstance(required, list) else ()):
        bound = len(declared) + MAX_EXTRA_PROPERTIES
        current = node.get("maxProperties")
        node["maxProperties"] = min(current, bound) if isinstance(current, int) else bound
    else:
        node["additionalProperties"] = False
        node.pop("patternProperties", None)
