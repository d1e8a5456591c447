"""The one admission path both fronts call: an authenticated tenant and a parsed
``GenerateRequest`` in, a started ``Generation`` (or a typed ``ServiceError``) out.

In order, each step once: every field read and checked (``RequestPrep.read``, no
tokenizer), the adapter selected and held, the tenant's limits charged for the input by its
size and for each of the ``n`` sequences (before any tokenizing), the prompt tokenized and
the output constraint compiled (``RequestPrep.build``), then the first sequence submitted.
Whatever was taken is released when a later step refuses, so a refusal holds nothing. The
fronts keep only their wire format: the gRPC servicer maps the started generation's events
to ``GenerateResponse`` messages, the HTTP front to OpenAI bodies.
"""

from __future__ import annotations

from collections.abc import Callable

from protos.kvfence.v1 import inference_pb2
from service.admission.generation import Generation, Recording, admit_all
from service.admission.limiter import Limiter
from service.admission.prep import RequestPrep
from service.admission.tenant_adapters import Adapters, BoundLease
from service.admission.tenants import Tenant
from service.protocols import EngineLike
from service.telemetry.request_metrics import RequestMetrics


class Admission:
    """Admits generations into ``engine`` for both fronts."""

    def __init__(
        self,
        engine: EngineLike,
        prep: RequestPrep,
        limiter: Limiter,
        adapters: Adapters,
        clock: Callable[[], float],
        is_draining: Callable[[], bool],
    ) -> None:
        self._engine = engine
        self._prep = prep
        self._limiter = limiter
        self._adapters = adapters
        self._clock = clock
        self._is_draining = is_draining

    async def start(
        self,
        tenant: Tenant,
        message: inference_pb2.GenerateRequest,
        request_id: str,
        deadline: float | None,
        recorder: RequestMetrics,
        *,
        sequences: int = 1,
        to_context_end: bool = False,
    ) -> Generation:
        """The started generation of ``message`` for ``tenant``: ``sequences`` engine
        sequences, the first one submitted. ``to_context_end``: an unset ``max_tokens``
        runs to the end of the context (the HTTP front's default). Raises ServiceError,
        holding nothing then."""
        fields = self._prep.read(tenant, message, to_context_end=to_context_end,
                                 sequences=sequences)
        adapter = await self._adapters.select(tenant, self._prep.model.resolve(message.model))
        # Charged before any work (tokenizing included): the input by its size, for each
        # of the n sequences.
        cost = fields.input.cost + fields.stopping.max_tokens
        try:
            leases = await admit_all(self._limiter, tenant.name, cost, sequences)
        except BaseException:
            adapter.release()
            raise
        leases[0] = BoundLease(leases[0], adapter)  # the adapter is held while any runs
        try:
            with recorder.trace.span("tokenize"):
                base = adapter.applied_to(
                    await self._prep.build(tenant, message, fields, request_id, deadline)
                )
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        gen = Generation(self._engine, base, leases, fields,
                         Recording(recorder, self._adapters, self._clock), self._is_draining)
        recorder.trace.submitted()
        await gen.start()
        return gen
