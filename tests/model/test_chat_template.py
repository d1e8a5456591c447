"""The sandboxed chat template environment."""

from __future__ import annotations

import re

import pytest

from service.model import ChatTemplate, ChatTemplateError


def test_raise_exception_becomes_chat_template_error() -> None:
    t = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        t.render([{"role": "assistant", "content": "x"}])


def test_sandbox_blocks_python_internals() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


def test_sandbox_is_immutable() -> None:
    t = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


def test_tojson_keeps_unicode_and_strftime_now_works() -> None:
    t = ChatTemplate("{{ messages[0] | tojson }}|{{ strftime_now('%Y') }}")
    out = t.render([{"role": "user", "content": "日本<b>"}])
    json_part, year = out.split("|")
    assert json_part == '{"role": "user", "content": "日本<b>"}'
    assert re.fullmatch(r"\d{4}", year)


def test_special_tokens_and_generation_prompt() -> None:
    t = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}",
        {"bos_token": "<s>", "eos_token": "</s>"},
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert t.render(msgs) == "<s>a</s>b</s>>"
    assert t.render(msgs, add_generation_prompt=False) == "<s>a</s>b</s>"


def test_generation_tag_and_loop_controls() -> None:
    t = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    assert (
        t.render([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]) == "one"
    )


def test_invalid_template_is_rejected() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for %}")
