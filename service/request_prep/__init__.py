"""Request preparation: one ``GenerateRequest`` -> one engine ``Request``, in one pass with
one owner (``RequestPrep``), the same for both fronts (the HTTP front translates the
OpenAI body into a ``GenerateRequest`` first).

1. ``fields``: the model step, then every field parsed and checked once (no tokenizer);
   the front then charges the input by its size;
2. ``prompt``: the input rendered (chat template) and tokenized, on the tenant's share of
   the tokenizer pool;
3. ``limits``: the prompt's length and the context it leaves;
4. ``grammar``: the output constraint compiled with the tenant's grammar cache;
5. ``prep``: the ``Request`` assembled. The engine trusts it (its invariants are assertions).

Each step module is visited once, in this order, and calls no other step.
"""
