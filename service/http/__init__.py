"""The OpenAI-compatible HTTP front: Starlette on uvicorn, in the gRPC server's event loop,
on the same engine, tenants, limits and validation as gRPC."""
