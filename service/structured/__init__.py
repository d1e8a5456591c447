"""Structured output: grammars, tool schemas, tool-call parsing and compiles.

- ``grammar`` (with ``grammar_depth`` and ``compile_executor``): the grammar runtime the
  engine's sampler runs (compiled grammars, matchers, the bounded compile executor); it
  imports nothing else of ``service``;
- ``compiler``: the grammar compiler for the served model's vocabulary;
- ``request_grammar``: a request's output constraint compiled with the tenant's cache;
- ``tools``, ``tool_schema``: tool calling at the service boundary, the same for both fronts;
- ``tool_calls``: tool calls read out of one sequence's streamed text.
"""
