"""The kvfence server process.

Top-level modules (one noun each; ``model/`` and ``engine/`` are their own packages):

- ``cli``: the ``kvfence`` command (serve, tenants add, models pull, certs dev, client verbs);
  ``env_flags``: ``KVFENCE_<FLAG>`` variables as flag defaults, checked only when used.
- ``dev``: ``make serve``: a dev tenant, a paste-ready command, then ``kvfence serve``.
- ``devcerts``: ``kvfence certs dev``: a development CA, server and tenant client certificates.
- ``config``: ``ServeConfig``, the one frozen config built from the ``serve`` flags
  (``serve_config``), and the pure functions deriving the engine/cache configs and KV budget.
- ``preflight``: every ``serve`` flag, the tenants file and the port, checked before loading.
- ``kv_shares``: each tenant's share of the KV pool, refused when they cannot all fit.
- ``app``: the composition root: builds model -> KV pool -> engine -> servers (the pool sized
  from the model's header first, so bad KV quotas are refused before the weights load); the
  ``serve`` process lifecycle;
  ``startup``: the slow start on a thread that Ctrl-C / SIGTERM can leave.
- ``grpc_server``: ``KVFenceServer``: gRPC server, health, reflection, metrics, reload, drain.
- ``inference_servicer`` / ``cache_servicer``: the ``Inference`` and ``Cache`` services.
- ``responses``: engine events -> ``GenerateResponse`` messages.
- ``prompt``: text / token ids / chat -> prompt token ids, with bounded work.
- ``validation``: request checks before any KV is allocated (INVALID_ARGUMENT).
- ``tenants``: the tenants file; ``auth``: credentials -> tenant, the auth interceptor.
- ``limits``: per-tenant concurrency and token-rate limits.
- ``errors``: ``ServiceError`` and the status-code table; ``finish``: engine outcomes -> errors.
- ``metrics``: Prometheus metrics on a dedicated registry; ``logging``: structlog setup.
- ``protocols``: the engine and cache methods the service layer uses.
"""
