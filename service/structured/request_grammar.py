"""Request preparation, step 4: the output constraint chosen in step 1 (a ``response_format``
or the grammar of a constrained tool choice) compiled on the compile executor with the
tenant's own cache, so one tenant's specs are never another's cache hits."""

from __future__ import annotations

import re

from service.errors import invalid_argument
from service.held_work import outlive_cancel
from service.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarSpec

# The position prefix of a Lark compile error, dropped once the error names its field.
_AT_LINE = re.compile(r"^at \d+(?:\(\d+\))?: ")


async def compile_grammar(
    compiler: GrammarCompiler | None, tenant: str, spec: GrammarSpec | None, field: str
) -> CompiledGrammar | None:
    """``spec`` compiled with the tenant's cache (None for none); INVALID_ARGUMENT naming
    ``field`` when it is too large, does not compile, or the server has no grammar support
    (or the field ``spec.line_fields`` names for the line of the source that failed)."""
    if spec is None:
        return None
    if compiler is None:
        raise invalid_argument([(field, "structured outputs are not enabled on this server")])
    reason = compiler.check(spec)  # cheap refusals without a thread hop
    if reason is not None:
        raise invalid_argument([(field, reason)])
    try:
        # NOTE: llguidance drops the GIL while it compiles, so the loop keeps serving.
        return await outlive_cancel(compiler.submit(tenant, spec))
    except GrammarError as err:
        where = dict(spec.line_fields).get(err.line) if err.line is not None else None
        if where is None:
            raise invalid_argument([(field, str(err))]) from None
        raise invalid_argument([(where, _AT_LINE.sub("", str(err)))]) from None
