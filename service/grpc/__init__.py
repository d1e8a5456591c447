"""The gRPC front: wire format only.

- ``interceptor``: authenticates every RPC but ``grpc.health.v1.Health``;
- ``inference_service`` / ``cache_service`` / ``adapter_service`` / ``health_service``: the
  ``Inference``, ``Cache``, ``Adapters`` and ``Health`` services;
- ``stream_messages``: engine events -> ``GenerateResponse`` messages;
- ``wire``: service registration with request parsing that cannot fail as UNKNOWN.

The process that serves both fronts is ``service.serve.server``; a generation is
admitted by ``service.admission`` (the one path both fronts call).
"""
