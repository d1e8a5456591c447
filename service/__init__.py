"""The kvfence server process.

Top-level modules (one noun each; ``model/`` and ``engine/`` are their own packages):

- ``cli``: the ``kvfence`` command (serve, tenants add, models pull, client verbs).
- ``devserve``: ``make serve``: a dev tenant, a paste-ready command, then ``serve``.
- ``serve``: builds model -> KV pool -> engine -> server; the ``serve`` process lifecycle.
- ``server``: ``KVFenceServer``: gRPC server, health, reflection, metrics, reload, drain.
- ``inference_servicer`` / ``cache_servicer``: the ``Inference`` and ``Cache`` services.
- ``responses``: engine events -> ``GenerateResponse`` messages.
- ``prompt``: text / token ids / chat -> prompt token ids, with bounded work.
- ``validation``: request checks before any KV is allocated (INVALID_ARGUMENT).
- ``tenants``: the tenants file; ``auth``: credentials -> tenant, the auth interceptor.
- ``limits``: per-tenant concurrency and token-rate limits.
- ``errors``: ``ServiceError`` and the status-code table; ``finish``: engine outcomes -> errors.
- ``cache_access``: KV-cache reads and purges from the event loop, under the engine lock.
- ``metrics``: Prometheus metrics on a dedicated registry; ``logging``: structlog setup.
- ``protocols``: the engine and cache methods the service layer uses.
"""
