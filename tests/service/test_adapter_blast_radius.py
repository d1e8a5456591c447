"""An adapter's values stay in its own rows (real server, tiny model, 127.0.0.1 port 0): an
adapter with a NaN or infinite weight or scaling is refused by name at start and on reload,
and a finite adapter whose rows overflow fails only its own request; the base rows and
another adapter's rows in the same steps get exactly their tokens alone."""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fixtures.tiny_lora import edit_adapter_config, write_random_lora
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.service.rpc import generate, request
from tests.service.test_lora_reload import _fresh, _reload

PROMPTS = [[5, 17, 42, 99, 7, 230, 11, 64, 3, 150, 77, 8], [9, 31, 200, 14, 6, 88, 120, 45]]
TOKENS = 24


def _lora(tiny_llama_dir: Path, directory: Path, seed: int, std: float = 0.08) -> Path:
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    write_random_lora(base, directory, rank=8, seed=seed, std=std, targets=("q_proj", "v_proj"))
    return directory


def _poison_weight(directory: Path, value: float) -> str:
    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = sorted(tensors)[0]
    tensors[key][0, 0] = value
    save_file(tensors, str(path))
    return key


def _tokens(out: list[Any]) -> list[int]:
    return [t for r in out if r.WhichOneof("event") == "chunk" for t in r.chunk.token_ids]


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ("nan weight", "holds NaN or infinite values"),
        ("inf weight", "holds NaN or infinite values"),
        ("nan alpha", "lora_alpha must be a finite number"),
        ("inf alpha", "lora_alpha must be a finite number"),
    ],
)
def test_a_non_finite_adapter_is_refused_by_name_at_start_and_on_reload(
    tiny_model: Any, tiny_llama_dir: Path, tmp_path: Path, edit: str, says: str
) -> None:
    from service.serve.settings import ConfigError

    bad = _lora(tiny_llama_dir, tmp_path / "bad", 1)
    value = math.nan if edit.startswith("nan") else math.inf
    if edit.endswith("weight"):
        key = _poison_weight(bad, value)
        says = f"{key!r} {says}"
    else:
        edit_adapter_config(bad, lora_alpha=value)  # json writes NaN / Infinity
    expected = f"adapter {bad}: {says}"
    tenants = {"acme": TenantSpec(adapters=(("bad", str(bad)),))}
    with pytest.raises(ConfigError) as err, running_server(
        tiny_model, tenants, tenants_dir=_fresh(tmp_path / "t1")
    ):
        pass
    assert str(err.value) == expected

    ok = _lora(tiny_llama_dir, tmp_path / "ok", 2)
    start = {"acme": TenantSpec(adapters=(("ok", str(ok)),))}
    with running_server(
        tiny_model, start, tenants_dir=_fresh(tmp_path / "t2"), log_stream=io.StringIO()
    ) as srv:
        assert not _reload(srv, {"acme": TenantSpec(adapters=(("ok", str(ok)), ("bad", str(bad))))})
        failed = [json.loads(line) for line in srv.log_lines() if "tenants.reload_failed" in line]
        assert failed[-1]["error"] == expected


@pytest.fixture(scope="module")
def srv(
    tiny_model: Any, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    root = tmp_path_factory.mktemp("blast-adapters")
    # Finite weights (the file is served) whose products overflow float32 in any row they
    # enter: a masked product over every row would turn the other rows' zeros into NaN.
    huge = _lora(tiny_llama_dir, root / "huge", 3)
    path = huge / "adapter_model.safetensors"
    save_file({k: torch.sign(t) * 1e38 for k, t in load_file(str(path)).items()}, str(path))
    good = _lora(tiny_llama_dir, root / "good", 4)
    tenants = {
        "attacker": TenantSpec(adapters=(("huge", str(huge)),)),
        "victim": TenantSpec(adapters=(("good", str(good)),)),
    }
    with running_server(tiny_model, tenants, tenants_dir=_fresh(root / "tenants")) as handle:
        yield handle


def _run(srv: ServerHandle, tenant: str, ids: list[int], model: str = "") -> list[int] | str:
    try:
        fields = {"model": model} if model else {}
        return _tokens(generate(srv, tenant, request(ids=ids, max_tokens=TOKENS, **fields)))
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"


def _wait_for_commands(srv: ServerHandle, n: int, timeout: float = 30.0) -> None:
    """Until ``n`` commands (the requests' submits) wait in the paused engine's inbox."""
    deadline = time.monotonic() + timeout
    while srv.engine._inbox.qsize() < n:
        assert time.monotonic() < deadline, f"{srv.engine._inbox.qsize()} of {n} submits queued"
        time.sleep(0.01)


def test_an_overflowing_adapter_fails_its_own_request_and_no_other_row(srv: ServerHandle) -> None:
    calls = [("victim", PROMPTS[0], ""), ("victim", PROMPTS[1], "good"), ("victim", PROMPTS[1], "")]
    alone = [_run(srv, *c) for c in calls]
    assert all(isinstance(a, list) and len(a) == TOKENS for a in alone), alone
    with ThreadPoolExecutor(8) as pool:
        for held in (True, False):
            # Held: every request reaches the engine at one step boundary, so the attacker's
            # rows share the step whose logits overflow with the victim's rows (left to
            # arrive as they come, a loaded machine can give the attacker a step of its own).
            with srv.paused_engine() if held else contextlib.nullcontext():
                attacks = [pool.submit(_run, srv, "attacker", p, "huge") for p in PROMPTS]
                beside = [pool.submit(_run, srv, *c) for c in calls]
                if held:
                    _wait_for_commands(srv, len(attacks) + len(beside))
            assert [f.result() for f in beside] == alone
            for f in attacks:
                assert f.result() == (
                    "INTERNAL: internal engine error: the model's logits for this request "
                    "are not finite"
                )
    assert _run(srv, "victim", PROMPTS[0]) == alone[0]
