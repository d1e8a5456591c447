"""Each tenant's LoRA adapters: declared in the tenants file, visible to that tenant alone.

``select`` resolves a request's model name inside the caller's own adapters only. A name the
caller has not declared (another tenant's adapter included) gets exactly the error a name
that exists nowhere gets, on the same path: one lookup in the caller's own table.

Every declared adapter is read and checked when the tenants file is applied (start and
SIGHUP): one that cannot be served fails the start, or fails the reload and keeps the old
file. Resident adapters are bounded per tenant; past the bound the least recently used idle
one is dropped and read again on its next request. A stream holds its adapter (the engine
request references it), so a changed or removed adapter's running streams finish on the
weights they started with.

A tenant whose file entry sets ``adapter_root`` may also load and unload adapters at run time
(``load_runtime``, ``unload_runtime``) from directories inside that root
(``adapter_paths``), with the checks a declared adapter gets (the loader's, the rank limit,
its memory counted against the tenant's KV share), at most ``--max-loras-per-tenant`` of
them. They are not written anywhere: a restart loses them, and a SIGHUP keeps each one whose
tenant still has an ``adapter_root`` holding it and whose name the file does not declare
(the file's adapter wins), read and checked again like the file's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from structlog.typing import FilteringBoundLogger

from protos.kvfence.v1 import cache_pb2, inference_pb2
from service.admission.adapter_paths import AdapterPathError, resolve_inside
from service.admission.kv_shares import KVShareError
from service.admission.limiter import LeaseLike
from service.admission.tenants import Tenant, TenantRegistry, valid_name
from service.engine.types import Finished, Request
from service.errors import (
    ServiceError,
    invalid_argument,
    permission_denied,
    resource_exhausted,
    unavailable,
)
from service.model.lora import LoraAdapter, LoraError, file_digest, load_lora
from service.model.model_config import ModelConfig
from service.telemetry.metrics import Metrics

UNKNOWN_MODEL = ("model", "is not served here (see ListModels)")
UNKNOWN_ADAPTER = ("lora_name", "names no adapter loaded at run time by this tenant")
#: Checks the tenants' adapter memory against their KV shares (raises ``KVShareError``).
ApplyPages = Callable[[Mapping[str, int]], None]


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The base the adapters are checked against, and the bounds (``--max-lora-rank``,
    ``--max-loras-per-tenant``)."""

    config: ModelConfig
    dtype: torch.dtype
    max_rank: int = 64
    max_resident_per_tenant: int = 4
    page_bytes: int = 0  # one KV page's bytes: adapter memory counts against KV shares in these


@dataclass(slots=True)
class AdapterLease:
    """The adapter a stream uses (None = the base) until ``release``."""

    adapter: LoraAdapter | None
    _owner: Adapters | None = None
    _tenant: str = ""

    def applied_to(self, request: Request) -> Request:
        """``request`` computed with this adapter (its prefix-cache namespace included)."""
        return request if self.adapter is None else dataclasses.replace(request, adapter=self.adapter)

    def release(self) -> None:
        if self._owner is not None and self.adapter is not None:
            self._owner._release(self._tenant, self.adapter.name)
            self._owner = None


@dataclass(slots=True)
class BoundLease:
    """A limiter lease that also releases the stream's adapter."""

    lease: LeaseLike
    adapter: AdapterLease

    def release(self) -> None:
        self.lease.release()
        self.adapter.release()


@dataclass(slots=True)
class _TenantAdapters:
    declared: dict[str, Path] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # bytes of each, once loaded
    resident: OrderedDict[str, LoraAdapter] = field(default_factory=OrderedDict)  # LRU first
    in_use: dict[str, int] = field(default_factory=dict)
    runtime: set[str] = field(default_factory=set)  # loaded through the API, not the file


class Adapters:
    """The tenants' declared and resident adapters; used on the server's event loop."""

    def __init__(
        self,
        settings: LoraSettings | None,
        base_name: str,
        log: FilteringBoundLogger,
        metrics: Metrics | None = None,
        apply_pages: ApplyPages = lambda pages: None,
    ) -> None:
        """``settings`` None: the served model takes no adapters; declaring one fails.
        ``apply_pages``: the server's check of the tenants' adapter memory against their KV
        shares, called as run-time loads and unloads change it."""
        self._settings = settings
        self._apply_pages = apply_pages
        self._metrics = metrics
        self._base = base_name
        self._log = log
        self._tenants: dict[str, _TenantAdapters] = {}
        # (tenant, adapter) -> [requests, prompt tokens, completion tokens]
        self._counts: dict[tuple[str, str], list[int]] = {}

    def _load(self, name: str, path: Path) -> LoraAdapter:
        s = self._settings
        if s is None:
            raise LoraError(f"adapter {path}: this server's model takes no adapters")
        return load_lora(name, path, s.config, s.dtype, s.max_rank)

    @property
    def _bound(self) -> int:
        return 0 if self._settings is None else self._settings.max_resident_per_tenant

    def prepare(self, registry: TenantRegistry) -> dict[str, _TenantAdapters]:
        """Read and check every adapter ``registry`` declares (an unchanged resident one is
        kept, by content digest). Raises LoraError naming the first that cannot be served;
        nothing changes until ``commit``."""
        out: dict[str, _TenantAdapters] = {}
        for tenant in registry.tenants.values():
            old = self._tenants.get(tenant.name, _TenantAdapters())
            new = _TenantAdapters(in_use=old.in_use)
            for name, raw in tenant.adapters:
                if name == self._base:
                    raise LoraError(
                        f"tenant {tenant.name!r}: adapter {name!r} has the base model's name"
                    )
                path = Path(raw)
                new.declared[name] = path
                if not path.is_dir():
                    raise LoraError(f"adapter {path}: not a directory")
                kept = old.resident.get(name)
                if kept is not None and kept.digest == file_digest(path):
                    adapter = kept
                else:
                    adapter = self._load(name, path)
                new.sizes[name] = adapter.nbytes
                if len(new.resident) < self._bound:
                    new.resident[name] = adapter
            self._carry_runtime(tenant, old, new)
            out[tenant.name] = new
        return out

    def _carry_runtime(self, tenant: Tenant, old: _TenantAdapters, new: _TenantAdapters) -> None:
        """Keep the run-time adapters the new file still allows (see the module), re-read."""
        for name in sorted(old.runtime):
            path = old.declared[name]
            try:
                if tenant.adapter_root is None or name in new.declared:
                    raise AdapterPathError("no longer allowed by the tenants file")
                path = resolve_inside(tenant.adapter_root, str(path))
                kept = old.resident.get(name)
                adapter = kept if kept is not None and kept.digest == file_digest(path) \
                    else self._load(name, path)
            except (AdapterPathError, LoraError) as err:
                self._log.warning("adapter.runtime_dropped", tenant=tenant.name, adapter=name,
                                  error=str(err))
                continue
            new.declared[name] = path
            new.runtime.add(name)
            new.sizes[name] = adapter.nbytes
            if len(new.resident) < self._bound:
                new.resident[name] = adapter

    def reserved_pages(self, prepared: Mapping[str, _TenantAdapters]) -> dict[str, int]:
        """KV pages each tenant's adapters take from its share: the most memory its resident
        adapters can hold at once (its largest ``max_resident_per_tenant``), in pages."""
        s = self._settings
        if s is None or s.page_bytes <= 0:
            return {}
        out = {}
        for tenant, entry in prepared.items():
            largest = sorted(entry.sizes.values(), reverse=True)[: s.max_resident_per_tenant]
            if largest:
                out[tenant] = -(-sum(largest) // s.page_bytes)
        return out

    def commit(self, prepared: dict[str, _TenantAdapters]) -> None:
        """Make ``prepared`` (from ``prepare``) the served set."""
        self._tenants = prepared
        count = sum(len(t.declared) for t in prepared.values())
        self._log.info("adapters.applied", adapters=count)

    async def load_runtime(self, tenant: Tenant, name: str, requested: str) -> None:
        """Load ``requested`` (inside the tenant's ``adapter_root``) as the tenant's adapter
        ``name``. Refuses (``ServiceError``) a tenant without a root (PERMISSION_DENIED), a
        name it already uses, a path outside the root, an adapter the loader refuses, one past
        ``--max-loras-per-tenant`` run-time adapters or past its KV share."""
        if tenant.adapter_root is None:
            raise permission_denied(
                "this tenant may not load adapters at run time (no adapter_root in the tenants "
                "file)", "NO_ADAPTER_ROOT")
        if self._settings is None:
            raise invalid_argument([("lora_name", "this server's model takes no adapters")])
        if not valid_name(name):
            raise invalid_argument([("lora_name", "letters, digits, '_', '.', '-' (at most 64)")])
        self._check_free(tenant, name)
        try:
            path = resolve_inside(tenant.adapter_root, requested)
            adapter = await asyncio.to_thread(self._load, name, path)
        except AdapterPathError as err:
            raise invalid_argument([("lora_path", str(err))]) from None
        except LoraError as err:  # its words name the resolved path: name the adapter
            text = str(err).replace(f"adapter {path}", f"adapter {name!r}", 1)
            raise invalid_argument([("lora_path", text)]) from None
        self._check_free(tenant, name)  # checked again: another load may have taken it
        entry = self._tenants.setdefault(tenant.name, _TenantAdapters())
        sizes = {**entry.sizes, name: adapter.nbytes}
        try:
            self._apply_pages(self.reserved_pages(
                {**self._tenants, tenant.name: dataclasses.replace(entry, sizes=sizes)}))
        except KVShareError as err:
            raise resource_exhausted("kv_memory", str(err)) from None
        entry.declared[name] = path
        entry.sizes[name] = adapter.nbytes
        entry.runtime.add(name)
        idle = [n for n in entry.resident if not entry.in_use.get(n)]
        if len(entry.resident) >= self._bound and idle:
            del entry.resident[idle[0]]
        if len(entry.resident) < self._bound:
            entry.resident[name] = adapter
        self._log.info("adapter.loaded", tenant=tenant.name, adapter=name, rank=adapter.rank)

    def _check_free(self, tenant: Tenant, name: str) -> None:
        entry = self._tenants.get(tenant.name, _TenantAdapters())
        if name == self._base or name in entry.declared:
            raise invalid_argument([("lora_name", f"this tenant already serves a model {name!r}")])
        if len(entry.runtime) >= self._bound:
            raise resource_exhausted(
                "adapters", f"this tenant has {self._bound} adapters loaded at run time, the "
                "most it may (--max-loras-per-tenant); unload one first")

    def unload_runtime(self, tenant: Tenant, name: str) -> None:
        """Drop the tenant's run-time adapter ``name``; its running streams finish on it.
        An unknown name, another tenant's and a file-declared one get the same refusal."""
        if tenant.adapter_root is None:
            raise permission_denied(
                "this tenant may not load adapters at run time (no adapter_root in the tenants "
                "file)", "NO_ADAPTER_ROOT")
        entry = self._tenants.get(tenant.name)
        if entry is None or name not in entry.runtime:
            raise invalid_argument([UNKNOWN_ADAPTER])
        entry.runtime.discard(name)
        del entry.declared[name]
        entry.sizes.pop(name, None)
        entry.resident.pop(name, None)
        entry.in_use.pop(name, None)
        self._apply_pages(self.reserved_pages(self._tenants))
        self._log.info("adapter.unloaded", tenant=tenant.name, adapter=name)

    def listing(self, tenant: Tenant) -> list[tuple[str, bool, bool]]:
        """(name, loaded at run time, resident) of each of the caller's adapters."""
        entry = self._tenants.get(tenant.name)
        if entry is None:
            return []
        return [(n, n in entry.runtime, n in entry.resident) for n in sorted(entry.declared)]

    def names(self, tenant: Tenant) -> tuple[str, ...]:
        """The caller's own adapter names (what its model lists show)."""
        entry = self._tenants.get(tenant.name)
        return () if entry is None else tuple(sorted(entry.declared))

    async def select(self, tenant: Tenant, model: str) -> AdapterLease:
        """The adapter ``model`` names among the caller's own, or the base for ``""`` and
        the base's name. Anything else raises the unknown-model error."""
        if not model or model == self._base:
            return AdapterLease(None)
        entry = self._tenants.get(tenant.name)
        if entry is None or model not in entry.declared:
            raise invalid_argument([UNKNOWN_MODEL])
        adapter = entry.resident.get(model)
        if adapter is None:
            entry, adapter = await self._reload(tenant.name, entry, model)
        entry.resident.move_to_end(model)
        entry.in_use[model] = entry.in_use.get(model, 0) + 1
        return AdapterLease(adapter, self, tenant.name)

    async def _reload(
        self, tenant: str, entry: _TenantAdapters, name: str
    ) -> tuple[_TenantAdapters, LoraAdapter]:
        """Read an evicted adapter again, making room among the idle resident ones; returns
        the tenant's entry in force once it is read (a reload may have replaced it)."""
        idle = [n for n in entry.resident if not entry.in_use.get(n)]
        if len(entry.resident) >= self._bound and not idle:
            raise resource_exhausted(
                "adapters", "every resident adapter of this tenant is in use", retry_after_s=1.0
            )
        path = entry.declared[name]
        try:
            adapter = await asyncio.to_thread(self._load, name, path)
        except LoraError as err:
            self._log.error("adapter.load_failed", tenant=tenant, adapter=name, error=str(err))
            raise unavailable("the adapter cannot be loaded now", retry_after_s=5.0) from None
        entry = self._tenants.get(tenant, entry)
        if entry.declared.get(name) != path:  # a reload removed or moved it while it was read
            raise _gone()
        if name in entry.resident:  # another request read it meanwhile
            return entry, entry.resident[name]
        while len(entry.resident) >= self._bound:
            victim = next((n for n in entry.resident if not entry.in_use.get(n)), None)
            if victim is None:
                raise resource_exhausted(
                    "adapters", "every resident adapter of this tenant is in use", 1.0
                )
            del entry.resident[victim]
            self._log.info("adapter.evicted", tenant=tenant, adapter=victim)
        entry.resident[name] = adapter
        return entry, adapter

    def _release(self, tenant: str, name: str) -> None:
        entry = self._tenants.get(tenant)
        if entry is not None and entry.in_use.get(name):
            entry.in_use[name] -= 1

    def record(self, request: Request, finished: Finished) -> None:
        """Count a finished stream against its adapter (nothing for the base)."""
        if request.adapter is None:
            return
        name = request.adapter.name
        counts = self._counts.setdefault((request.tenant, name), [0, 0, 0])
        counts[0] += 1
        counts[1] += finished.prompt_tokens
        counts[2] += finished.completion_tokens
        if self._metrics is not None:
            tenant = self._metrics.label(request.tenant)
            self._metrics.adapter_requests.labels(tenant, name).inc()
            tokens = self._metrics.adapter_tokens
            tokens.labels(tenant, name, "prompt").inc(finished.prompt_tokens)
            tokens.labels(tenant, name, "completion").inc(finished.completion_tokens)

    def usage(self, tenant: Tenant) -> list[cache_pb2.AdapterUsage]:
        """The caller's declared adapters with what their requests used."""
        entry = self._tenants.get(tenant.name)
        if entry is None:
            return []
        out = []
        for name in sorted(entry.declared):
            requests, prompt, completion = self._counts.get((tenant.name, name), (0, 0, 0))
            out.append(
                cache_pb2.AdapterUsage(
                    name=name,
                    requests=requests,
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    resident=name in entry.resident,
                )
            )
        return out

    def resident(self) -> Mapping[str, tuple[str, ...]]:
        """Resident adapter names per tenant, least recently used first (tests, metrics)."""
        return {t: tuple(e.resident) for t, e in self._tenants.items()}


def model_infos(
    base: inference_pb2.ModelInfo, adapters: Sequence[str]
) -> list[inference_pb2.ModelInfo]:
    """The base model's entry, then one per adapter of the caller (``base_model`` set)."""
    out = [base]
    for name in adapters:
        info = inference_pb2.ModelInfo()
        info.CopyFrom(base)
        info.name = name
        info.base_model = base.name
        out.append(info)
    return out


def _gone() -> ServiceError:
    return unavailable("the adapter changed while it loaded; retry", retry_after_s=0.1)
