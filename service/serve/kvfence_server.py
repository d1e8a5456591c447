"""The gRPC server: servicers, auth, health, reflection, metrics, reload and drain.

``KVFenceServer`` is handed a started engine and its cache; it owns neither. Lifecycle::

    server = KVFenceServer(...); await server.start()   # health SERVING
    server.reload_tenants()                              # SIGHUP
    await server.drain()                                 # SIGTERM: see ``drain``
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from structlog.typing import FilteringBoundLogger

from protos.kvfence.v1 import adapters_pb2, cache_pb2, inference_pb2
from service.admission.auth import Authenticator
from service.admission.cluster_limits import build_cluster_limiter
from service.admission.gate import Admission
from service.admission.kv_shares import KVShareError, kv_shares, tier_shares
from service.admission.limiter import Limiter, TenantLimiter
from service.admission.prep import RequestPrep
from service.admission.prompt import ChatTemplateLike, PromptBuilder, TokenizerLike
from service.admission.refusal_pace import RefusalPace
from service.admission.request_fields import ModelLimits, prompt_token_limit
from service.admission.tenant_adapters import Adapters, LoraSettings
from service.admission.tenants import Tenant, TenantRegistry, TenantsFileError, load_tenants
from service.admission.tokenizer_pool import TokenizerPool
from service.engine import TenantCachePolicy, TenantSchedPolicy
from service.errors import ServiceError
from service.grpc.adapter_service import AdaptersServicer
from service.grpc.cache_service import CacheServicer
from service.grpc.health_service import BoundedHealth
from service.grpc.inference_service import InferenceOptions, InferenceServicer
from service.grpc.interceptor import AuthInterceptor
from service.grpc.wire import add_adapters_service, add_cache_service, add_inference_service
from service.http.deps import FrontDeps
from service.http.front import OpenAIFront
from service.http.guard import HttpGuard
from service.http.pacing import PacedAnswers
from service.http.server import HttpServer
from service.model.lora import LoraError
from service.protocols import EngineLike
from service.serve.settings import ServerOptions, TlsFiles
from service.serve.shared_prefixes import SharedPrefixPublisher
from service.structured.grammar import GrammarCompiler
from service.telemetry.metrics import EngineGauges, Metrics, MetricsServer
from service.telemetry.request_metrics import PageAlert
from service.telemetry.tracing import Tracing

SERVICE_NAMES = (
    inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name,
    adapters_pb2.DESCRIPTOR.services_by_name["Adapters"].full_name,
)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the server needs to know about the loaded model."""

    name: str
    architecture: str
    dtype: str
    vocab_size: int
    max_model_len: int
    tokenizer: TokenizerLike
    chat_template: ChatTemplateLike | None
    default_ttl_s: float
    lora: LoraSettings | None = None  # None = adapters are refused (declaring one fails)


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Keepalive without a max connection age: long streams are never cut.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # A connection with no call for 5 minutes is sent GOAWAY (clients reconnect on their
        # next call): idle connections do not hold descriptors for ever.
        ("grpc.max_connection_idle_ms", 300_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


class KVFenceServer:
    def __init__(
        self,
        *,
        engine: EngineLike,
        model: ServedModel,
        registry: TenantRegistry,
        options: ServerOptions,
        log: FilteringBoundLogger,
        tenants_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        names = options.served_model_names
        if names:  # --served-model-name: the first is the model's name from here on
            model = replace(model, name=names[0])
        self._engine = engine
        self._grammars = grammars
        self._model = model
        self._options = options
        self._log = log
        self._tenants_path = tenants_path
        self._clock = clock
        self._draining = False
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._health_service: BoundedHealth | None = None  # set by start()
        self._stats_task: asyncio.Task[None] | None = None
        self._alerted: set[str] = set()
        self.metrics = Metrics(registry.names())
        self.metrics_server: MetricsServer | None = None
        self.authenticator = Authenticator(registry)
        self.limiter: Limiter = (
            TenantLimiter(clock)
            if options.cluster_limits is None
            else build_cluster_limiter(
                options.cluster_limits, registry=self.metrics.registry, log=log, clock=clock
            )
        )
        self.port = 0
        self.http: HttpServer | None = None
        self.http_front: OpenAIFront | None = None
        self.adapters = Adapters(
            model.lora, model.name, log, self.metrics, apply_pages=self.apply_adapter_pages
        )
        self.shared_prefixes = SharedPrefixPublisher(
            engine, model.tokenizer, log, model.chat_template
        )
        adapters = self.adapters.prepare(registry)  # LoraError: refuse to start
        self._apply(registry, self.adapters.reserved_pages(adapters))
        self.adapters.commit(adapters)
        limits = ModelLimits(
            model.name, model.vocab_size, model.max_model_len, tuple(dict.fromkeys(names[1:]))
        )
        # Tokenizer time is charged to the tenant's fair share of the engine, like compiles.
        self._tokenizer_pool = TokenizerPool(options.tokenizer_threads, on_cost=engine.charge_cpu)
        self.prep = RequestPrep(
            limits,
            PromptBuilder(model.tokenizer, model.chat_template, self._tokenizer_pool),
            grammars,
        )
        self.tracing = (
            Tracing.otlp(options.otlp_endpoint, log) if options.otlp_endpoint else Tracing.off()
        )
        self.admission = Admission(
            engine, self.prep, self.limiter, self.adapters, clock, lambda: self._draining
        )
        self.inference = InferenceServicer(
            self.admission,
            self.prep,
            self.limiter,
            self.metrics,
            log,
            InferenceOptions(
                model_info=inference_pb2.ModelInfo(
                    name=model.name,
                    architecture=model.architecture,
                    max_model_len=model.max_model_len,
                    vocab_size=model.vocab_size,
                    dtype=model.dtype,
                ),
                page_size=engine.page_size,
                log_content=options.log_content,
                alert_request_kv_pages=options.alert_request_kv_pages,
            ),
            clock,
            self.tracing,
            self.adapters,
        )

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def health_watches(self) -> int:
        """Health ``Watch`` streams open now (capped by ``--max-health-watches``); 0
        before :meth:`start`."""
        return 0 if self._health_service is None else self._health_service.watching

    async def start(self) -> int:
        """Bind, start serving and mark health SERVING. Returns the bound port."""
        opts = self._options
        interceptor = AuthInterceptor(
            self.authenticator,
            lambda: self._draining,
            self._log,
            on_denied=lambda code: self.metrics.auth_denials.labels(code).inc(),
            client_certs=opts.tls is not None and opts.tls.client_ca is not None,
            pace=RefusalPace(),
            cheap=RefusalPace(max_wait_s=2.0),
            prompt_tokens=self._prompt_tokens,
            max_message_bytes=opts.max_message_bytes,
        )
        server = grpc.aio.server(
            interceptors=[interceptor], options=grpc_options(opts.max_message_bytes)
        )
        add_inference_service(self.inference, server)
        add_cache_service(
            CacheServicer(
                self._engine.usage,
                self._purge,
                self._engine.page_size,
                self._model.default_ttl_s,
                self.limiter,
                self.metrics,
                self.adapters,
            ),
            server,
        )
        add_adapters_service(
            AdaptersServicer(self.adapters, self.metrics), server
        )
        self._health_service = BoundedHealth(self._health, opts.max_health_watches)
        health_pb2_grpc.add_HealthServicer_to_server(self._health_service, server)
        if opts.reflection:
            names = (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, server)
        address = f"{opts.host}:{opts.port}"
        if opts.tls is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, _credentials(opts.tls))
        await self.shared_prefixes.settled()  # the first requests already read them
        await server.start()
        self._server = server
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if opts.metrics_port is not None:
            self.metrics_server = MetricsServer(self.metrics, opts.metrics_host, opts.metrics_port)
        if opts.http_port is not None:
            await self._start_http()
        await self.refresh_stats()
        self._stats_task = asyncio.create_task(self._stats_loop())
        await self.limiter.start()
        return self.port

    def _prompt_tokens(self, tenant: Tenant) -> int:
        """The prompt tokens ``tenant`` may send: what bounds its requests' bytes."""
        return prompt_token_limit(self.prep.model, tenant.quotas.max_prompt_tokens)

    async def _start_http(self) -> None:
        opts = self._options
        self.http_front = OpenAIFront(
            FrontDeps(
                engine=self._engine,
                admission=self.admission,
                prep=self.prep,
                limiter=self.limiter,
                authenticator=self.authenticator,
                metrics=self.metrics,
                log=self._log,
                is_draining=lambda: self._draining,
                clock=self._clock,
                alert=PageAlert(self._engine.page_size, opts.alert_request_kv_pages),
                tracing=self.tracing,
                adapters=self.adapters,
                metrics_on_http=opts.metrics_on_http,
            )
        )
        tls = opts.tls
        guard = opts.http_guard or HttpGuard()
        authenticator = self.authenticator
        peers = guard.pace()  # 401s and /health per peer, from the gate and the app alike
        app = PacedAnswers(
            self.http_front.app(),
            lambda headers: authenticator.authenticate(headers, {}),
            peers=peers,
            tenants=guard.pace(),
        )

        def gate(headers: list[tuple[str, str]]) -> ServiceError | None:
            if self._draining:
                return None  # the app answers 503
            try:
                authenticator.authenticate(headers, {})
            except ServiceError as err:
                return err
            return None

        self.http = HttpServer(
            app,
            opts.http_host or opts.host,
            opts.http_port or 0,
            tls_cert=tls.cert if tls else None,
            tls_key=tls.key if tls else None,
            client_ca=tls.client_ca if tls else None,
            guard=guard,
            gate=gate,
            pace=peers,
        )
        await self.http.start()

    def reload_tenants(self) -> bool:
        """Re-read the tenants file (SIGHUP). In-flight streams continue; a revoked key is
        refused from the next call. A broken file, or an adapter that cannot be served, is
        logged and the old file kept; streams on a changed or removed adapter finish on it."""
        if self._tenants_path is None:
            return False
        try:
            registry = load_tenants(self._tenants_path)
            adapters = self.adapters.prepare(registry)
            self._apply(registry, self.adapters.reserved_pages(adapters))
        except (TenantsFileError, KVShareError, LoraError) as err:
            self._log.error("tenants.reload_failed", error=str(err))
            return False
        self.adapters.commit(adapters)
        self.authenticator.replace(registry)
        self.metrics.set_tenants(registry.names())
        self._log.info("tenants.reloaded", tenants=len(registry.tenants))
        return True

    async def _purge(self, tenant: str) -> int:
        """Drop the tenant's cached prefixes and its compiled grammars: after a purge, neither
        cache answers faster for anything the tenant sent before."""
        if self._grammars is not None:
            self._grammars.forget(tenant)
        return await self._engine.purge(tenant)

    def apply_adapter_pages(self, adapter_pages: Mapping[str, int]) -> None:
        """``_apply`` with the tenants in force: a run-time adapter load or unload changed
        what the tenants' adapters take from their shares."""
        self._apply(self.authenticator.registry, adapter_pages)

    def _apply(self, registry: TenantRegistry, adapter_pages: Mapping[str, int]) -> None:
        """Push the tenants' limits and the shared prefixes to the limiter and the engine.
        Raises ``KVShareError`` (before changing anything) when their KV shares cannot all
        be honoured, counting each tenant's adapters (``adapter_pages``) against its own
        share; the pages kept for shared prefixes are no tenant's."""
        engine = self._engine
        shares = kv_shares(
            registry.tenants, engine.num_pages - engine.shared_pages, self._options.kv_overcommit
        )
        tier = tier_shares(registry.tenants, engine.tier_bytes) if engine.tier_bytes else {}
        for name, pages in adapter_pages.items():
            if shares[name] - pages < 1:
                raise KVShareError(
                    f"tenant {name!r}: its LoRA adapters take {pages} KV pages of memory, its "
                    f"whole share of {shares[name]}; raise its share or --kv-memory, or lower "
                    "--max-loras-per-tenant"
                )
            shares[name] -= pages
        self.shared_prefixes.apply(registry.shared_prefixes)
        for tenant in registry.tenants.values():
            q = tenant.quotas
            self.limiter.configure(tenant.name, q)
            self._engine.set_tenant_policy(
                tenant.name,
                TenantSchedPolicy(
                    weight=tenant.weight,
                    max_running=q.max_concurrent_streams,
                    max_waiting=q.max_concurrent_streams,
                ),
                TenantCachePolicy(
                    max_pages=shares[tenant.name],
                    ttl_s=tenant.prefix_cache_ttl_seconds,
                    tier_bytes=tier.get(tenant.name),
                    shared_prefixes=frozenset(tenant.shared_prefixes),
                ),
            )

    async def drain(self, grace_s: float | None = None) -> None:
        """SIGTERM: health NOT_SERVING and new RPCs UNAVAILABLE at once; in-flight streams
        get ``grace_s`` to finish; the rest are aborted in the engine (pages freed) and end
        with UNAVAILABLE; then the server stops."""
        grace = self._options.grace_s if grace_s is None else grace_s
        self._draining = True
        await self._health.enter_graceful_shutdown()
        self._log.info("server.draining", in_flight=self.limiter.total_active(), grace_s=grace)
        await self._wait_idle(grace)
        aborted = await self._engine.abort_all()
        await self._wait_idle(5.0)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await self.close()
        self._log.info("server.stopped", aborted=aborted)

    async def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
            self._stats_task = None
        if self.http is not None:
            await self.http.stop()
            self.http = None
        await self.limiter.close()
        if self._server is not None:
            await self._server.stop(grace=None)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        self._tokenizer_pool.shutdown()
        # Off the loop: the exporter's last flush may wait on the collector.
        await asyncio.to_thread(self.tracing.close)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def _wait_idle(self, timeout_s: float) -> None:
        deadline = self._clock() + timeout_s
        while self.limiter.total_active() > 0 and self._clock() < deadline:
            await asyncio.sleep(0.02)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self._options.stats_interval_s)
            try:
                await self.refresh_stats()
            except Exception as err:  # a scrape snapshot must never take the server down
                self._log.warning("metrics.refresh_failed", error=type(err).__name__)

    async def refresh_stats(self) -> None:
        """Snapshot cache and engine gauges for /metrics and check the tenant KV alert."""
        snapshot = await self._engine.stats()
        stats = snapshot.cache
        gauges = EngineGauges(snapshot.counters.num_waiting, snapshot.counters.num_running)
        self.metrics.observe_cache(stats, gauges)
        threshold = self._options.alert_tenant_kv_pages
        if threshold <= 0:
            return
        for name, usage in stats.tenants.items():
            pages = usage.pages_in_use + usage.pages_cached
            if pages > threshold and name not in self._alerted:
                self._alerted.add(name)
                self._log.warning(
                    "kv.alert.tenant_pages", tenant=name, pages=pages, threshold=threshold
                )
                self.metrics.kv_alerts.labels(self.metrics.label(name), "tenant").inc()
            elif pages <= threshold:
                self._alerted.discard(name)


def _credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    key, cert = tls.key.read_bytes(), tls.cert.read_bytes()
    client_ca = tls.client_ca.read_bytes() if tls.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


__all__ = ["KVFenceServer", "ServedModel", "ServerOptions", "TlsFiles"]
