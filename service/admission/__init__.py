"""Admission: the one path both fronts call, from an authenticated caller and a parsed
``GenerateRequest`` to a started generation or a typed refusal.

- ``gate``: ``Admission.start``: read, select the adapter, charge the limits, tokenize,
  submit; the fronts keep only their wire format;
- ``auth`` and ``tenants``: credentials -> ``Tenant``, from the tenants file;
- ``limiter`` (per replica), ``cluster_limits`` and ``redis_scripts`` (across replicas):
  concurrency and token-rate limits; ``kv_shares``: each tenant's share of the KV pool;
- ``request_size``: what a request may cost before it is parsed;
  ``refusal_pace``: pacing of refused calls per peer;
- request preparation, one pass with one owner (``prep.RequestPrep``), each step module
  visited once and calling no other step: ``request_fields`` (every field parsed and checked,
  no tokenizer), ``prompt`` (rendered and tokenized on the tenant's share of
  ``tokenizer_pool``), ``prompt_limits`` (the prompt against the limits and context), then
  the output constraint (``service.structured.request_grammar``);
- ``tenant_adapters`` and ``adapter_paths``: each tenant's LoRA adapters;
- ``generation``: the ``n`` engine sequences of one request as one event stream;
  ``outcomes``: engine outcomes other than a normal stop -> service errors.
"""
