"""The kvfence server process, in packages by job:

- ``model/``: the served model (loaders, families, tokenizer, chat template, native kernels);
- ``engine/``: the continuous-batching engine (scheduler, cost model, sampler, detokenizer);
- ``structured/``: grammars, tool schemas, tool-call parsing and compiles;
- ``admission/``: auth, tenants, limits and request preparation: the one path both fronts call;
- ``grpc/`` and ``http/``: the two fronts, wire format only;
- ``telemetry/``: logs, metrics and traces;
- ``serve/``: the ``kvfence`` command, configuration, the composition root, the server
  process that runs both fronts (reload, drain) and its lifecycle.

Top-level modules, shared by several packages: ``errors`` (``ServiceError`` and the
status-code table), ``protocols`` (what the service layer needs from the engine),
``json_input`` (JSON a client sends, read the same way everywhere) and ``held_work``
(waiting on another thread without letting a cancelled caller leave early).
"""
