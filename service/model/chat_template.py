"""Chat templates: the model's own Jinja template, rendered in a sandbox as transformers does."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

ToolFormat = Literal["hermes", "llama3_json", "mistral"]


def tool_format_of(source: str) -> ToolFormat:
    """The tool-call convention a template's family uses, read from its markup; Hermes
    (``<tool_call>``) also for templates without tools (the generic rendering)."""
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<tool_call>" not in source and ("<|python_tag|>" in source or "ipython" in source):
        return "llama3_json"
    return "hermes"


class ChatTemplateError(ValueError):
    """The template is invalid, or it refused the conversation (``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (used for training masks) as a no-op."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_passthrough"), [], [], body).set_lineno(
            lineno
        )

    def _passthrough(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """Renders a conversation into the prompt text the model was trained on."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = _environment()
        try:
            self._template = env.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"invalid chat template: {e}") from None
        self.source = source
        self._special = dict(special_tokens or {})
        #: The template renders ``tools`` itself (else the service's generic rendering).
        self.native_tools = "tools" in variables
        self.tool_format: ToolFormat = tool_format_of(source)

    def render_parts(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[tuple[str, bool]]:
        """The rendered prompt as ``(text, is_content)`` pieces: message content apart from
        the template's own markup, so the tokenizer can keep content from spelling control
        tokens. Joined, the pieces are ``render``'s output wherever the template inserts
        content verbatim (as chat templates do).

        Each content is rendered as a random marker and put back afterwards. A template that
        transforms content (``| trim``) transforms the marker instead, so such content goes
        in as sent.
        """
        nonce = secrets.token_hex(16)
        marked = [{**m, "content": f"\x00{nonce}:{i}\x00"} for i, m in enumerate(messages)]
        rendered = self.render(marked, add_generation_prompt, tools)
        pattern = re.compile(f"\x00{nonce}:(\\d+)\x00")
        parts: list[tuple[str, bool]] = []
        at = 0
        for match in pattern.finditer(rendered):
            parts.append((rendered[at : match.start()], False))
            parts.append((messages[int(match.group(1))]["content"], True))
            at = match.end()
        parts.append((rendered[at:], False))
        return [(text, is_content) for text, is_content in parts if text]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        extra: dict[str, Any] = {"tools": [dict(t) for t in tools]} if tools else {}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **extra,
                **self._special,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None
