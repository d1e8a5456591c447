"""Structured outputs hold on the default model: every JSON-schema-constrained completion
through the HTTP front (``openai`` SDK) parses and validates against its schema.

The schemas are bounded (string lengths, integer ranges, array sizes; no unbounded numbers),
so even written one byte per token with every character escaped (6 bytes) a complete document
fits ``MAX_TOKENS``; the constraint, not the model, guarantees the result.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from service.serve.app import EngineSizing
from service.serve.kvfence_server import ServerOptions
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.recorder import Recorder
from tests.verify.scale import size

COMPLETIONS = size(10, 100)
MAX_TOKENS = 400
SIZING = EngineSizing(kv_memory="64MiB", max_model_len=512, warmup=False, dtype="float32")
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Lima", "Oslo", "Cairo"]},
            "temps": {"type": "array", "items": {"type": "integer", "minimum": -50,
                                                 "maximum": 50}, "minItems": 1, "maxItems": 4},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "temps", "sunny"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                     "maxItems": 3},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "meta": {"type": "object", "properties": {"draft": {"type": "boolean"}},
                     "required": ["draft"], "additionalProperties": False},
        },
        "required": ["title", "tags", "rating", "meta"],
        "additionalProperties": False,
    },
]
PROMPTS = ["Describe a person.", "Report the weather.", "Review a book.", "Say anything."]


@pytest.fixture(scope="module")
def srv(default_model: Any) -> Iterator[ServerHandle]:
    with running_server(default_model, {"acme": TenantSpec(max_concurrent_streams=16)},
                        sizing=SIZING, options=ServerOptions(http_port=0)) as handle:
        yield handle


def _one(srv: ServerHandle, i: int) -> tuple[bool, str]:
    import openai

    assert srv.server.http is not None
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server.http.port}/v1",
                           api_key=srv.keys["acme"], max_retries=0, timeout=300)
    schema = SCHEMAS[i % len(SCHEMAS)]
    r = client.chat.completions.create(
        model=srv.stack.model.name,
        messages=[{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} Answer in JSON."}],
        max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
    )
    text = r.choices[0].message.content or ""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as err:
        return False, f"{r.choices[0].finish_reason}: {type(err).__name__}"
    return True, ""


@pytest.mark.timeout(size(400, 1800))
def test_json_schema_completions_all_validate(srv: ServerHandle, record: Recorder) -> None:
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _one(srv, i), range(COMPLETIONS)))
    ok = sum(1 for good, _ in results if good)
    failures = [why for good, why in results if not good][:3]
    assert record("JSON-schema completions that parse and validate (default model)",
                  f"{ok}/{COMPLETIONS}", f"== {COMPLETIONS}/{COMPLETIONS}",
                  ok == COMPLETIONS), failures
