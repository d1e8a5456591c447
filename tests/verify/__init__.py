"""Shared machinery of the isolation and reliability suite (``tests/isolation``,
``tests/reliability``) and of ``make verify``.

- ``scale``: one code path, two sizes (``KVFENCE_VERIFY=full`` or short).
- ``recorder``: the ``record`` fixture; every figure a test asserts is recorded.
- ``plugin``: collects the figures and test outcomes into one table, verify.json and verify.md.
- ``fixtures``: session models (tiny, medium) and the ``record`` fixture for the conftests.
- ``calls``: building requests and reading streams and statuses over gRPC.
- ``pool``: "the KV pool and the engine are back at baseline", and a free-time probe.
- ``greedy``: comparing two greedy generations, with the documented near-tie rule.
- ``stats``: percentiles and a pure-Python Mann-Whitney U test.
- ``pki``: throwaway CAs and certificates for the TLS cases.
- ``models``: the medium random-weight Llama.
"""
