"""``Adapters``' run-time loads alone: ``--max-loras-per-tenant`` bounds them, a load its
tenant's KV share cannot hold is refused and leaves nothing behind, and the accounting a
load or unload pushes counts the adapter exactly."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from service.admission.kv_shares import KVShareError
from service.admission.tenant_adapters import Adapters, LoraSettings
from service.admission.tenants import Tenant, TenantRegistry
from service.errors import ServiceError
from service.telemetry.logs import make_logger
from tests.fixtures.tiny_lora import write_random_lora

PAGE_BYTES = 4096


@pytest.fixture(scope="module")
def root(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaForCausalLM

    top = tmp_path_factory.mktemp("adapters-runtime")
    for i, name in enumerate(("x", "y")):
        base = LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
        write_random_lora(base, top / name, rank=4, seed=i, std=0.05)
    return top


class Shares:
    """The server's check, recorded: refuses any tenant's adapters past ``limit`` pages."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pushed: list[dict[str, int]] = []

    def __call__(self, pages: Mapping[str, int]) -> None:
        if any(p > self.limit for p in pages.values()):
            raise KVShareError("tenant 'acme': its LoRA adapters take too many KV pages")
        self.pushed.append(dict(pages))


def _adapters(tiny_model: Any, bound: int, shares: Shares) -> Adapters:
    settings = LoraSettings(tiny_model.model.config, torch.float32, 64, bound, PAGE_BYTES)
    adapters = Adapters(settings, "base", make_logger("json", io.StringIO()), apply_pages=shares)
    adapters.commit(adapters.prepare(TenantRegistry({"acme": Tenant("acme")})))
    return adapters


def _refused(adapters: Adapters, tenant: Tenant, name: str, path: str) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        asyncio.run(adapters.load_runtime(tenant, name, path))
    return err.value


def test_run_time_loads_are_bounded_per_tenant_and_counted_in_pages(
    tiny_model: Any, root: Path,
) -> None:
    shares = Shares(limit=10**9)
    adapters = _adapters(tiny_model, 1, shares)
    acme = Tenant("acme", adapter_root=str(root))
    asyncio.run(adapters.load_runtime(acme, "x", "x"))
    [pushed] = shares.pushed
    assert pushed["acme"] > 0
    err = _refused(adapters, acme, "y", "y")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loras-per-tenant" in err.message
    adapters.unload_runtime(acme, "x")
    assert shares.pushed[-1] == {}
    asyncio.run(adapters.load_runtime(acme, "y", "y"))
    assert adapters.listing(acme) == [("y", True, True)]


def test_a_load_past_the_tenants_kv_share_is_refused_and_leaves_nothing(
    tiny_model: Any, root: Path,
) -> None:
    shares = Shares(limit=0)
    adapters = _adapters(tiny_model, 4, shares)
    acme = Tenant("acme", adapter_root=str(root))
    err = _refused(adapters, acme, "x", "x")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pages" in err.message
    assert adapters.listing(acme) == [] and adapters.names(acme) == ()
    assert shares.pushed == []
