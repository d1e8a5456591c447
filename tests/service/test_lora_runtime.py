"""Adapters loaded and unloaded at run time through a real server (gRPC ``kvfence.v1.Adapters``
and HTTP ``/v1/load_lora_adapter``): a loaded adapter's tokens equal its peft-merged model,
it is the loading tenant's alone (another tenant gets exactly what an unknown name gets),
an unloaded one is unknown again, only paths inside the tenant's ``adapter_root`` load
(``..``, absolute paths and symlinks out refused alike), a tenant without a root is
refused, a NaN adapter is refused naming it, and a SIGHUP keeps what the file still allows."""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from protos.kvfence.v1 import adapters_pb2, adapters_pb2_grpc, inference_pb2
from service.admission.adapter_paths import OUTSIDE
from service.serve.kvfence_server import ServerOptions
from tests.fixtures.tiny_lora import write_random_lora
from tests.http.conftest import base_url
from tests.serverutil import ServerHandle, TenantSpec, running_server, write_tenants_file
from tests.service.rpc import details, generate, request, stubs
from tools.parity.checks import hf_agrees_with_greedy

PROMPT = [5, 17, 42, 99, 7, 230, 11, 64, 3, 150, 77, 8, 21, 33, 190, 12]
TOKENS = 12


def _hf(tiny_llama_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def made(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """acme's adapter_root and ``good``'s peft-merged model. In the root: ``good``, ``nan``
    (one weight NaN), ``out`` a symlink to a directory outside, ``linked`` a directory whose
    weights file links outside."""
    top = tmp_path_factory.mktemp("runtime")
    base = top / "root"
    base.mkdir()
    merged = write_random_lora(_hf(tiny_llama_dir), base / "good", rank=8, seed=3, std=0.08)
    write_random_lora(_hf(tiny_llama_dir), base / "nan", rank=8, seed=4, std=0.08)
    weights = base / "nan" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors[sorted(tensors)[0]][0, 0] = math.nan
    save_file(tensors, str(weights))
    write_random_lora(_hf(tiny_llama_dir), top / "outside", rank=8, seed=5, std=0.08)
    os.symlink(top / "outside", base / "out")
    (base / "linked").mkdir()
    (base / "linked" / "adapter_config.json").write_bytes(
        (top / "outside" / "adapter_config.json").read_bytes())
    os.symlink(top / "outside" / "adapter_model.safetensors",
               base / "linked" / "adapter_model.safetensors")
    return base, merged


@pytest.fixture(scope="module")
def root(made: tuple[Path, Any]) -> Path:
    return made[0]


@pytest.fixture(scope="module")
def merged(made: tuple[Path, Any]) -> Any:
    return made[1]


def _tenants(root: Path) -> dict[str, TenantSpec]:
    return {"acme": TenantSpec(adapter_root=str(root)), "globex": TenantSpec()}


@pytest.fixture(scope="module")
def srv(tiny_model: Any, root: Path, tmp_path_factory: pytest.TempPathFactory,
        ) -> Iterator[ServerHandle]:
    with running_server(tiny_model, _tenants(root), options=ServerOptions(http_port=0),
                        tenants_dir=tmp_path_factory.mktemp("runtime-tenants")) as handle:
        yield handle


def _stub(srv: ServerHandle) -> adapters_pb2_grpc.AdaptersStub:
    return adapters_pb2_grpc.AdaptersStub(srv.channel())


def _load(srv: ServerHandle, tenant: str, name: str, path: str) -> adapters_pb2.LoadAdapterResponse:
    reply: adapters_pb2.LoadAdapterResponse = _stub(srv).LoadAdapter(
        adapters_pb2.LoadAdapterRequest(name=name, path=path), metadata=srv.auth(tenant))
    return reply


def _unload(srv: ServerHandle, tenant: str, name: str) -> None:
    _stub(srv).UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name=name), metadata=srv.auth(tenant))


def _listed(srv: ServerHandle, tenant: str) -> list[tuple[str, bool]]:
    out = _stub(srv).ListAdapters(adapters_pb2.ListAdaptersRequest(), metadata=srv.auth(tenant))
    return [(a.name, a.loaded_at_run_time) for a in out.adapters]


def _refusal(call: Any) -> tuple[grpc.StatusCode, str, list[tuple[str, str]]]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    violations = []
    if err.value.code() == grpc.StatusCode.INVALID_ARGUMENT:
        violations = [(v.field, v.description)
                      for v in details(err.value)["BadRequest"].field_violations]
    return err.value.code(), err.value.details(), violations


def _tokens(srv: ServerHandle, tenant: str, model: str) -> list[int]:
    out = generate(srv, tenant, request(ids=PROMPT, max_tokens=TOKENS, model=model))
    return [t for r in out if r.WhichOneof("event") == "chunk" for t in r.chunk.token_ids]


def _models(srv: ServerHandle, tenant: str) -> list[str]:
    inference, _ = stubs(srv)
    out = inference.ListModels(inference_pb2.ListModelsRequest(), metadata=srv.auth(tenant))
    return [m.name for m in out.models]


def test_a_loaded_adapter_serves_its_merged_tokens_to_its_tenant_alone_until_unloaded(
    srv: ServerHandle, merged: Any,
) -> None:
    base = _tokens(srv, "acme", "")
    unknown = _refusal(lambda: _tokens(srv, "globex", "nope"))
    reply = _load(srv, "acme", "mine", "good")
    assert (reply.adapter.name, reply.adapter.loaded_at_run_time) == ("mine", True)
    assert _listed(srv, "acme") == [("mine", True)] and _listed(srv, "globex") == []
    assert "mine" in _models(srv, "acme") and "mine" not in _models(srv, "globex")
    got = _tokens(srv, "acme", "mine")
    assert got != base and hf_agrees_with_greedy(merged, PROMPT, got)
    # Another tenant naming it gets what a name that exists nowhere gets, word for word.
    assert _refusal(lambda: _tokens(srv, "globex", "mine")) == unknown
    assert _refusal(lambda: _unload(srv, "globex", "mine"))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert _refusal(lambda: _load(srv, "acme", "mine", "good"))[2] == [
        ("lora_name", "this tenant already serves a model 'mine'")]
    _unload(srv, "acme", "mine")
    assert _listed(srv, "acme") == [] and "mine" not in _models(srv, "acme")
    code, _, violations = _refusal(lambda: _tokens(srv, "acme", "mine"))
    assert (code, violations) == (unknown[0], unknown[2])
    assert _refusal(lambda: _unload(srv, "acme", "mine"))[2] == [
        ("lora_name", "names no adapter loaded at run time by this tenant")]


@pytest.mark.parametrize("path", ["../outside", "{top}/outside", "out", "linked",
                                  "good/../../outside", "{top}/nowhere"])
def test_a_path_that_resolves_outside_the_root_is_refused_alike(
    srv: ServerHandle, root: Path, path: str,
) -> None:
    requested = path.format(top=root.parent)
    code, _, violations = _refusal(lambda: _load(srv, "acme", "x", requested))
    assert (code, violations) == (grpc.StatusCode.INVALID_ARGUMENT, [("lora_path", OUTSIDE)])
    assert _listed(srv, "acme") == []


def test_a_nan_adapter_is_refused_naming_it_and_a_tenant_without_a_root_may_not_load(
    srv: ServerHandle,
) -> None:
    code, _, [(field, reason)] = _refusal(lambda: _load(srv, "acme", "bad", "nan"))
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "lora_path")
    assert reason.startswith("adapter 'bad': '") and "holds NaN or infinite values" in reason
    code, message, _ = _refusal(lambda: _load(srv, "globex", "g", "good"))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "adapter_root" in message
    assert _listed(srv, "acme") == [] and _listed(srv, "globex") == []


def _post(srv: ServerHandle, tenant: str | None, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {srv.keys[tenant]}"} if tenant else {}
    return httpx.post(base_url(srv) + path, content=json.dumps(body).encode(),
                      headers={**headers, "Content-Type": "application/json"}, timeout=60)


def _http_models(srv: ServerHandle, tenant: str) -> list[str]:
    r = httpx.get(base_url(srv) + "/models", timeout=60,
                  headers={"Authorization": f"Bearer {srv.keys[tenant]}"})
    return [m["id"] for m in r.json()["data"]]


def test_http_loads_and_unloads_in_vllms_shapes_for_the_caller_alone(srv: ServerHandle) -> None:
    load = {"lora_name": "web", "lora_path": "good"}
    assert _post(srv, None, "/load_lora_adapter", load).status_code == 401
    r = _post(srv, "acme", "/load_lora_adapter", load)
    assert (r.status_code, r.json()) == (200, {"lora_name": "web", "loaded": True})
    assert "web" in _http_models(srv, "acme") and "web" not in _http_models(srv, "globex")
    assert _post(srv, "globex", "/load_lora_adapter", load).status_code == 403
    chat: dict[str, Any] = {"model": "web", "prompt": "hi", "max_tokens": 2}
    assert _post(srv, "acme", "/completions", chat).status_code == 200
    other = _post(srv, "globex", "/completions", chat)
    nowhere = _post(srv, "globex", "/completions", {**chat, "model": "nowhere"})
    assert other.status_code == 400
    assert other.json()["error"]["message"] == nowhere.json()["error"]["message"]
    r = _post(srv, "acme", "/unload_lora_adapter", {"lora_name": "web"})
    assert (r.status_code, r.json()) == (200, {"lora_name": "web", "unloaded": True})
    assert "web" not in _http_models(srv, "acme")
    r = _post(srv, "acme", "/load_lora_adapter", {"lora_name": "web", "lora_path": "../outside"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_a_reload_keeps_a_run_time_adapter_while_the_file_allows_it(srv: ServerHandle, root: Path) -> None:
    _load(srv, "acme", "kept", "good")

    def reload(acme: TenantSpec) -> None:
        write_tenants_file(srv.tenants_path, {
            "acme": acme, "globex": TenantSpec(api_key=srv.keys["globex"])})
        done = asyncio.run_coroutine_threadsafe(
            asyncio.to_thread(srv.server.reload_tenants), srv.loop)
        assert done.result(30)

    reload(TenantSpec(api_key=srv.keys["acme"], adapter_root=str(root)))
    assert _listed(srv, "acme") == [("kept", True)]
    reload(TenantSpec(api_key=srv.keys["acme"]))  # the root withdrawn: the adapter goes
    assert _listed(srv, "acme") == []
    reload(TenantSpec(api_key=srv.keys["acme"], adapter_root=str(root)))
