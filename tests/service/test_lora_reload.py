"""Adapters added, changed and removed by a tenants-file reload (what SIGHUP runs) while
streams on them run: no stream fails, a removed name is then unknown, and a changed adapter
never reuses the KV its previous content produced."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from service.serve.kvfence_server import ServerOptions
from tests.fixtures.tiny_lora import write_random_lora
from tests.serverutil import ServerHandle, TenantSpec, running_server, write_tenants_file
from tests.service.rpc import details, generate, request, stubs

PROMPT = [5, 17, 42, 99, 7, 230, 11, 64, 3, 150, 77, 8, 21, 33, 190, 12, 61, 18, 40, 4] * 2


def _lora(tiny_llama_dir: Path, directory: Path, seed: int) -> None:
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    write_random_lora(base, directory, rank=8, seed=seed, std=0.08)


def _fresh(directory: Path) -> Path:
    directory.mkdir()
    return directory


def _tokens(responses: list[Any]) -> list[int]:
    return [t for r in responses if r.WhichOneof("event") == "chunk" for t in r.chunk.token_ids]


def _reload(srv: ServerHandle, tenants: dict[str, TenantSpec]) -> bool:
    write_tenants_file(
        srv.tenants_path,
        {name: TenantSpec(api_key=srv.keys[name], adapters=s.adapters) for name, s in tenants.items()},
    )
    done = asyncio.run_coroutine_threadsafe(asyncio.to_thread(srv.server.reload_tenants), srv.loop)
    return bool(done.result(30))


@pytest.mark.slow  # four 300-token streams through the adapter path: ~40 s on a loaded 2-core box
def test_adding_changing_and_removing_adapters_under_load_fails_no_stream(
    tiny_model: Any, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    for name, seed in (("keep", 1), ("change", 2), ("drop", 3), ("new", 4)):
        _lora(tiny_llama_dir, tmp_path / name, seed)
    live = tmp_path / "live"  # the path the tenants file names for "change"
    shutil.copytree(tmp_path / "change", live)
    first = {
        "acme": TenantSpec(
            adapters=(("keep", str(tmp_path / "keep")), ("change", str(live)), ("drop", str(tmp_path / "drop")))
        )
    }
    with running_server(tiny_model, first, tenants_dir=_fresh(tmp_path / "t")) as srv:
        inference, _ = stubs(srv)

        def gen(model: str, max_tokens: int) -> list[Any]:
            return generate(srv, "acme", request(ids=PROMPT, max_tokens=max_tokens, model=model))

        before = _tokens(gen("change", 8))
        streams = [
            inference.Generate(
                request(ids=PROMPT, max_tokens=300, model=m), metadata=srv.auth("acme")
            )
            for m in ("keep", "change", "drop", "")
        ]
        for stream in streams:
            assert next(stream).WhichOneof("event") == "started"
        shutil.rmtree(live)
        shutil.copytree(tmp_path / "new", live)  # same path, new content
        second = {
            "acme": TenantSpec(adapters=(("keep", str(tmp_path / "keep")), ("change", str(live)),
                                         ("new", str(tmp_path / "new"))))
        }
        with srv.paused_engine():  # the reload lands while every stream is mid-decode
            assert _reload(srv, second)
            assert srv.engine.num_running() == len(streams)
        for stream in streams:  # every stream, removed and changed adapters' included, ends
            assert list(stream)[-1].finished.usage.completion_tokens == 300
        with pytest.raises(grpc.RpcError) as gone:
            gen("drop", 4)
        with pytest.raises(grpc.RpcError) as unknown:
            gen("never-declared", 4)
        assert (gone.value.code(), gone.value.details(), details(gone.value)) == (
            unknown.value.code(), unknown.value.details(), details(unknown.value)
        )
        changed = gen("change", 8)
        assert changed[0].started.cached_prompt_tokens == 0  # the old content's pages are not reused
        assert _tokens(changed) != before
        assert _tokens(changed) == _tokens(gen("new", 8))  # same content as "new"


def test_a_reload_naming_an_adapter_that_cannot_be_served_keeps_the_old_file(
    tiny_model: Any, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    _lora(tiny_llama_dir, tmp_path / "ok", 1)
    tenants = {"acme": TenantSpec(adapters=(("ok", str(tmp_path / "ok")),))}
    log = io.StringIO()
    with running_server(tiny_model, tenants, tenants_dir=_fresh(tmp_path / "t"), log_stream=log) as srv:
        missing = str(tmp_path / "missing")
        bad = {"acme": TenantSpec(adapters=(("ok", str(tmp_path / "ok")), ("bad", missing)))}
        assert not _reload(srv, bad)
        failed = [json.loads(line) for line in srv.log_lines() if "tenants.reload_failed" in line]
        assert failed[-1]["error"] == f"adapter {missing}: not a directory"
        out = generate(srv, "acme", request(ids=PROMPT, max_tokens=2, model="ok"))
        assert out[-1].finished.usage.completion_tokens == 2


def test_a_start_naming_an_adapter_that_cannot_be_served_is_refused_in_one_line(
    tiny_model: Any, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from service.serve.settings import ConfigError

    _lora(tiny_llama_dir, tmp_path / "big", 1)
    tenants = {"acme": TenantSpec(adapters=(("big", str(tmp_path / "big")),))}
    with pytest.raises(ConfigError) as err, running_server(
        tiny_model, tenants, tenants_dir=_fresh(tmp_path / "t"),
        options=ServerOptions(max_lora_rank=4),
    ):
        pass
    assert str(err.value) == (
        f"adapter {tmp_path / 'big'}: rank 8 is above the maximum 4 (--max-lora-rank)"
    )


def test_sighup_to_a_serving_process_swaps_adapters_and_started_streams_finish(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from protos.kvfence.v1 import inference_pb2, inference_pb2_grpc
    from tests.serverutil import start_server_process

    for name, seed in (("keep", 1), ("drop", 3), ("new", 4)):
        _lora(tiny_llama_dir, tmp_path / name, seed)
    tenants = tmp_path / "tenants.toml"
    keep, drop, new = (("keep", str(tmp_path / "keep")), ("drop", str(tmp_path / "drop")),
                       ("new", str(tmp_path / "new")))
    keys = write_tenants_file(tenants, {"acme": TenantSpec(adapters=(keep, drop))})
    proc = start_server_process(tiny_llama_dir, tenants)
    auth = (("authorization", f"Bearer {keys['acme']}"),)
    try:
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(proc.target))

        def gen(model: str, max_tokens: int) -> list[Any]:
            req = request(ids=PROMPT, max_tokens=max_tokens, model=model)
            return list(stub.Generate(req, metadata=auth))

        def listed() -> list[str]:
            resp = stub.ListModels(inference_pb2.ListModelsRequest(), metadata=auth)
            return [m.name for m in resp.models[1:]]

        assert listed() == ["drop", "keep"]
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(gen, m, 300) for m in ("keep", "drop", "keep", "drop")]
            time.sleep(1.0)
            write_tenants_file(
                tenants, {"acme": TenantSpec(api_key=keys["acme"], adapters=(keep, new))}
            )
            proc.popen.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while listed() != ["keep", "new"]:
                assert time.monotonic() < deadline, "the reload did not swap the adapters"
                time.sleep(0.05)
            results = [f.result(120) for f in streams]
        assert [out[-1].finished.usage.completion_tokens for out in results] == [300] * 4
        assert gen("new", 3)[-1].finished.usage.completion_tokens == 3
        with pytest.raises(grpc.RpcError) as gone:
            gen("drop", 3)
        assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        proc.stop()
