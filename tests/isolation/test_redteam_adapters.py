"""Noisy neighbours through their own adapters. Tenant ``attacker`` streams through a LoRA of
its own while tenant ``victim`` sends short greedy requests over gRPC: an adapter on PEFT's
default targets for Llama (``q_proj`` and ``v_proj``), and a finite adapter whose products
overflow float32 in any row they enter. The victim's requests must not fail, its tokens must
be its tokens alone, and its gap (p50 and p90) and TTFT stay within ``_judge_flood``'s bounds;
an adapter with NaN weights is refused by name at start."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from protos.kvfence.v1 import inference_pb2_grpc
from service.serve.settings import ConfigError
from tests.isolation.test_noisy_neighbour import _sizing, _vocab
from tests.isolation.test_redteam_neighbours import _judge_flood
from tests.model.test_lora_stack import write_adapter
from tests.serverutil import ServerHandle, TenantSpec, running_server
from tests.verify.calls import collect, gen_request
from tests.verify.neighbours import AttackStats, Latency, Victim, attack
from tests.verify.recorder import Recorder
from tests.verify.scale import is_full, size

VICTIM_N = size(4, 15)
VICTIM_PROMPT = 24
VICTIM_MAX_TOKENS = size(8, 16)
SETTLE_S = size(0.5, 2.0)
ATTACK_TOKENS = size(16, 48)


@pytest.fixture(scope="module")
def loaded(request: pytest.FixtureRequest) -> Any:
    from service.model import load_model

    path = Path(request.getfixturevalue("default_model_path" if is_full() else "tiny_dir"))
    return load_model(path, dtype="auto" if is_full() else "float32", progress=False)


def _overflowing(directory: Path) -> Path:
    """Finite weights of 1e38 (the file passes every check at load): x @ A.T overflows in
    any row it is computed for."""
    path = directory / "adapter_model.safetensors"
    save_file({k: torch.sign(t) * 1e38 for k, t in load_file(str(path)).items()}, str(path))
    return directory


@pytest.fixture(scope="module")
def adapters(loaded: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("redteam-adapters")
    return {
        "qv": write_adapter(root / "qv", loaded, 8, seed=1, targets=("q_proj", "v_proj")),
        "huge": _overflowing(write_adapter(root / "huge", loaded, 8, seed=2)),
    }


@pytest.fixture(scope="module")
def asrv(
    loaded: Any, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    tenants = {
        "victim": TenantSpec(),
        "attacker": TenantSpec(adapters=tuple((n, str(p)) for n, p in adapters.items())),
    }
    with running_server(
        loaded, tenants, sizing=_sizing(), tenants_dir=tmp_path_factory.mktemp("tenants")
    ) as handle:
        yield handle


def _victim(handle: ServerHandle) -> Victim:
    return Victim(
        handle.target, handle.auth("victim"), _vocab(handle), VICTIM_PROMPT, VICTIM_MAX_TOKENS
    )


@pytest.fixture(scope="module")
def base(asrv: ServerHandle) -> Latency:
    _victim(asrv).run(2)
    return _victim(asrv).run(VICTIM_N)


def _adapter_loop(handle: ServerHandle, model: str) -> Any:
    vocab = _vocab(handle)

    def work(channel: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        stub = inference_pb2_grpc.InferenceStub(channel)
        n = 0
        while not stop.is_set():
            n += 1
            ids = [vocab[0] + (i * 7919 + n * 31 + j) % (vocab[1] - vocab[0]) for j in range(32)]
            req = gen_request(ids, max_tokens=ATTACK_TOKENS)
            req.model = model
            out = collect(stub.Generate(req, metadata=handle.auth("attacker"), timeout=120))
            stats.count(out.code, 32, len(out.tokens))

    return work


def _fixed_victim_tokens(handle: ServerHandle) -> list[list[int]]:
    """The victim's greedy tokens for three fixed prompts."""
    stub = inference_pb2_grpc.InferenceStub(handle.channel())
    lo, hi = _vocab(handle)
    out = []
    for k in range(3):
        ids = [lo + (k * 131 + j * 17) % (hi - lo) for j in range(VICTIM_PROMPT)]
        out.append(collect(stub.Generate(gen_request(ids, max_tokens=VICTIM_MAX_TOKENS),
                                         metadata=handle.auth("victim"), timeout=120)).tokens)
    return out


def test_an_adapter_on_pefts_default_targets_beside_the_victim(
    asrv: ServerHandle, base: Latency, record: Recorder
) -> None:
    alone = _fixed_victim_tokens(asrv)
    with attack(asrv.target, _adapter_loop(asrv, "qv"), 2, SETTLE_S) as stats:
        under = _victim(asrv).run(VICTIM_N)
        beside = _fixed_victim_tokens(asrv)
    failed = stats.calls - stats.codes["OK"]
    ok = record("attacker's q_proj/v_proj adapter requests failed", failed, "== 0", failed == 0)
    ok &= record("attacker's adapter requests served", stats.codes["OK"], ">= 1",
                 stats.codes["OK"] >= 1)
    differing = sum(a != b for a, b in zip(alone, beside, strict=True))
    ok &= record("victim requests with tokens differing from alone", differing, "== 0",
                 differing == 0)
    _judge_flood(record, base, under, stats)
    assert ok


def test_an_overflowing_adapter_beside_the_victim(
    asrv: ServerHandle, base: Latency, record: Recorder
) -> None:
    alone = _fixed_victim_tokens(asrv)
    with attack(asrv.target, _adapter_loop(asrv, "huge"), 2, SETTLE_S) as stats:
        under = _victim(asrv).run(VICTIM_N)
        beside = _fixed_victim_tokens(asrv)
    differing = sum(a != b for a, b in zip(alone, beside, strict=True))
    ok = record("victim requests with tokens differing from alone", differing, "== 0",
                differing == 0)
    internal = stats.codes["INTERNAL"]
    ok &= record("attacker's overflowing requests failed INTERNAL", f"{internal}/{stats.calls}",
                 "all", internal == stats.calls and internal >= 1)
    _judge_flood(record, base, under, stats)
    assert ok


def test_an_adapter_with_nan_weights_is_refused_at_start(
    loaded: Any, tmp_path: Path, record: Recorder
) -> None:
    bad = write_adapter(tmp_path / "nan", loaded, 8, seed=3)
    path = bad / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))
    (tmp_path / "tenants").mkdir()
    tenants = {"attacker": TenantSpec(adapters=(("nan", str(bad)),))}
    try:
        with running_server(loaded, tenants, sizing=_sizing(), tenants_dir=tmp_path / "tenants"):
            said = "served"
    except ConfigError as err:
        said = str(err)
    want = f"adapter {bad}: {key!r} holds NaN or infinite values"
    assert record("a NaN adapter at start", "refused by name" if said == want else said,
                  "refused by name", said == want)
