"""Grammar depth bounds (``grammar_depth``) and the compiler's refusal of specs nested past
``GrammarLimits``: measured on the source, before llguidance's recursive walk sees it."""

from __future__ import annotations

import json

import pytest

from service.structured.compile_executor import CompileExecutor
from service.structured.grammar import GrammarCompiler, GrammarError, GrammarLimits, GrammarSpec
from service.structured.grammar_depth import (
    json_nesting,
    json_ref_depth,
    lark_depth,
    lark_json_schemas,
    longest_weighted_path,
)
from tests.engine.test_grammar import _compiler


def lark_chain(n: int) -> str:
    """``start: a0``, ``a0: a1``, ... ``a{n}: "x"``: a rule chain n + 2 deep."""
    return "start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(n)) + f'a{n}: "x"\n'


def ref_chain(n: int) -> str:
    defs: dict[str, object] = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/a0", "$defs": defs})


JSON_LARK = """?start: value
?value: object | array | string | NUMBER | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : /"[^"]*"/  // a comment naming rules: value object array
NUMBER: /[0-9]+/
%ignore " "
"""


def test_a_rule_chain_is_as_deep_as_it_is_long() -> None:
    assert lark_depth(lark_chain(2800)) == 2802


def test_recursion_counts_its_cycle_once_with_its_brackets() -> None:
    # value, object, array, pair form one cycle: 1 + 3 + 3 + 1, then string and NUMBER.
    assert lark_depth(JSON_LARK) == 10


def test_strings_regexes_and_comments_name_no_rules() -> None:
    src = 'start: "a0 a1" /a0|a1/ b // a0\nb: "x"\na0: a1\na1: a0 a0 a0\n'
    assert lark_depth(src) == 2  # start -> b; the a0/a1 cycle is not reachable from text


def test_the_path_bound_covers_every_walk_of_a_cycle() -> None:
    # A cycle of 5 reached from a chain of 3: any walk visits at most all of them.
    graph = {"s": {"x"}, "x": {"y"}, "y": {"c0"}, **{f"c{i}": {f"c{(i + 1) % 5}"} for i in range(5)}}
    assert longest_weighted_path(graph, dict.fromkeys(graph, 1)) == 8


def test_json_nesting_ignores_brackets_in_strings() -> None:
    assert json_nesting('{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_nesting("[" * 5000 + "]" * 5000) == 5000


def test_json_ref_depth_follows_the_definitions() -> None:
    assert json_ref_depth(json.loads(ref_chain(2000))) == 2002
    cyclic = {"$ref": "#/$defs/n", "$defs": {"n": {"properties": {"next": {"$ref": "#/$defs/n"}}}}}
    assert json_ref_depth(cyclic) == 2


def test_a_2800_rule_chain_is_refused_naming_the_limit() -> None:
    # Through a compile executor, as the server compiles: were the check off, the chain
    # would compile on the large stack (and not crash this test's process).
    executor = CompileExecutor()
    gc = _compiler()
    compiler = GrammarCompiler(gc._vocab, gc.limits, executor)
    try:
        with pytest.raises(GrammarError, match="rules nest 2802 deep; the limit is 1000"):
            compiler.submit("t", GrammarSpec("lark", lark_chain(2800))).result(60)
    finally:
        executor.shutdown()


def test_a_chain_within_the_limit_and_a_recursive_grammar_compile() -> None:
    gc = _compiler()
    gc.compile("t", GrammarSpec("lark", lark_chain(900)))
    gc.compile("t", GrammarSpec("lark", JSON_LARK))
    assert gc.cached("t") == 2


def test_a_deep_schema_is_refused_naming_the_depth_limit() -> None:
    gc: GrammarCompiler = _compiler()
    nested: object = {"type": "string"}
    for _ in range(150):
        nested = {"type": "array", "items": nested}
    with pytest.raises(GrammarError, match="nests 151 levels deep; the limit is 100"):
        gc.compile("t", GrammarSpec("json_schema", json.dumps(nested)))
    deep_text = "[" * 100_000 + "]" * 100_000  # Python's own json parser would recurse
    with pytest.raises(GrammarError, match="the limit is 100"):
        _compiler(GrammarLimits(max_source_bytes=1 << 20)).compile(
            "t", GrammarSpec("json_schema", deep_text)
        )


def test_a_long_ref_chain_is_refused_naming_the_limit() -> None:
    with pytest.raises(GrammarError, match=r"\$refs chain 2002 deep; the limit is 1000"):
        _compiler(GrammarLimits(max_source_bytes=1 << 20)).compile(
            "t", GrammarSpec("json_schema", ref_chain(2000))
        )


def test_lark_json_schemas_are_found_outside_strings_and_comments() -> None:
    source = (
        'start: a | "%json {" b\n'
        "// %json {not a schema\n"
        'a: %json {"type": "string", "description": "} ]"}\n'
        'b:  %json  {"type": "integer"} "x"\n'
    )
    assert lark_json_schemas(source) == [
        (3, '{"type": "string", "description": "} ]"}'), (4, '{"type": "integer"}')]


def test_a_lark_grammar_is_refused_for_its_embedded_schema_naming_the_line() -> None:
    """A ``%json`` schema is held to the JSON schema bounds (a tool grammar embeds one per
    tool): a $ref chain past the depth limit, or nesting past the JSON limit, is refused
    with the line it is on."""
    gc = _compiler(GrammarLimits(max_source_bytes=1 << 20))
    chain = f'start: "x" | a\na: %json {ref_chain(1100)}\n'
    with pytest.raises(GrammarError, match=r"^at 2: %json schema \$refs chain 1102 deep") as err:
        gc.compile("t", GrammarSpec("lark", chain))
    assert err.value.line == 2
    nested = 'start: a\na: "y"\nb: "z"\nc: %json ' + json.dumps(_nested_schema(120)) + "\n"
    with pytest.raises(GrammarError, match=r"^at 4: %json schema nests 121 levels deep; the limit is 100") as err:
        gc.compile("t", GrammarSpec("lark", nested))
    assert err.value.line == 4
    gc.compile("t", GrammarSpec("lark", f'start: a\na: %json {ref_chain(50)}\n'))


def _nested_schema(levels: int) -> dict[str, object]:
    nested: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        nested = {"type": "array", "items": nested}
    return nested
