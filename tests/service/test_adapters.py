"""``service.admission.tenant_adapters.Adapters`` alone: per-tenant lookup, the resident bound with LRU
eviction of idle adapters, and reading an evicted adapter again on demand."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from service.admission.tenant_adapters import Adapters, LoraSettings
from service.admission.tenants import Tenant, TenantRegistry
from service.errors import ServiceError
from service.telemetry.logs import make_logger
from tests.fixtures.tiny_lora import write_random_lora


@pytest.fixture(scope="module")
def lora_dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("adapters-unit")
    out = {}
    for i, name in enumerate(("x", "y")):
        base = LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
        write_random_lora(base, root / name, rank=4, seed=i, std=0.05)
        out[name] = root / name
    return out


def _adapters(tiny_model: Any, dirs: dict[str, Path], bound: int) -> tuple[Adapters, Tenant, Tenant]:
    acme = Tenant("acme", adapters=tuple((n, str(p)) for n, p in sorted(dirs.items())))
    globex = Tenant("globex")
    settings = LoraSettings(tiny_model.model.config, torch.float32, 64, bound)
    adapters = Adapters(settings, "base", make_logger("json", io.StringIO()))
    adapters.commit(adapters.prepare(TenantRegistry({"acme": acme, "globex": globex})))
    return adapters, acme, globex


def test_idle_adapters_past_the_bound_are_evicted_lru_and_read_again(
    tiny_model: Any, lora_dirs: dict[str, Path]
) -> None:
    adapters, acme, _ = _adapters(tiny_model, lora_dirs, bound=1)
    assert adapters.resident() == {"acme": ("x",), "globex": ()}
    lease = asyncio.run(adapters.select(acme, "y"))  # x is idle: evicted, y read
    assert lease.adapter is not None and lease.adapter.name == "y"
    assert adapters.resident()["acme"] == ("y",)
    with pytest.raises(ServiceError) as busy:  # y is serving: x cannot displace it
        asyncio.run(adapters.select(acme, "x"))
    assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    lease.release()
    again = asyncio.run(adapters.select(acme, "x"))
    assert again.adapter is not None and again.adapter.name == "x"
    assert adapters.resident()["acme"] == ("x",)


def test_the_base_name_or_nothing_selects_the_base_and_others_adapters_are_unknown(
    tiny_model: Any, lora_dirs: dict[str, Path]
) -> None:
    adapters, acme, globex = _adapters(tiny_model, lora_dirs, bound=4)
    assert asyncio.run(adapters.select(acme, "")).adapter is None
    assert asyncio.run(adapters.select(acme, "base")).adapter is None
    errors = []
    for tenant, name in ((globex, "x"), (globex, "nowhere"), (acme, "nowhere")):
        with pytest.raises(ServiceError) as err:
            asyncio.run(adapters.select(tenant, name))
        errors.append((err.value.code, err.value.message, err.value.details))
    assert errors[0] == errors[1] == errors[2]
    assert errors[0][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert adapters.names(acme) == ("x", "y") and adapters.names(globex) == ()
