"""PEFT adapters on the default model through a real server, on whichever kernel tier this
process builds (``make test-slow`` runs the native tier, ``make sanitize`` the ``avx2`` and
``portable`` builds): an adapter on PEFT's default targets for Llama (``q_proj`` and
``v_proj``) and one on all seven projections decode in the native stack beside base rows and
alone, and each request's greedy tokens are transformers + peft's merged model's (but for
exact ties)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from service.model.native import kernels
from tests.fixtures.tiny_lora import ALL_TARGETS, write_random_lora
from tests.serverutil import TEST_SIZING, ServerHandle, TenantSpec, running_server
from tests.service.rpc import generate, request
from tools.parity.checks import TIE_TOL, logits_hf
from tools.parity.corpus import PROMPTS

# The transformers oracle of the default model and two merged copies: minutes on 2 cores.
pytestmark = pytest.mark.slow

TOKENS = 12
ADAPTERS = {"qv": ("q_proj", "v_proj"), "all": ALL_TARGETS}


@pytest.fixture(scope="module")
def merged(hf_oracle: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tier-adapters")
    out: dict[str, Any] = {"": hf_oracle[0]}
    for i, (name, targets) in enumerate(ADAPTERS.items()):
        out[name] = write_random_lora(
            copy.deepcopy(hf_oracle[0]), root / name, rank=8, seed=20 + i,
            std=0.1 if name == "qv" else 0.05,
            targets=targets,
        )  # fmt: skip
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def srv(default_model_path: Path, merged: dict[str, Any]) -> Iterator[ServerHandle]:
    root: Path = merged["root"]
    (root / "tenants").mkdir()
    adapters = tuple((name, str(root / name)) for name in ADAPTERS)
    sizing = replace(TEST_SIZING, kv_memory="96MiB", dtype="float32")
    with running_server(
        default_model_path, {"acme": TenantSpec(adapters=adapters)}, sizing=sizing,
        tenants_dir=root / "tenants",
    ) as handle:  # fmt: skip
        yield handle


def _oracle_agrees(hf_model: Any, ids: list[int], ours: list[int]) -> bool:
    """transformers' greedy pick after each of our prefixes is ours, or ties with it."""
    logits = logits_hf(hf_model, [*ids, *ours[:-1]])[len(ids) - 1 :]
    picks = logits.argmax(dim=-1).tolist()
    return all(
        float(logits[i, a] - logits[i, b]) <= TIE_TOL
        for i, (a, b) in enumerate(zip(picks, ours, strict=True))
    )


def test_adapters_decode_in_the_native_stack_as_peft_computes_them(
    srv: ServerHandle, merged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    stack_calls = {"with adapters": 0}
    original = kernels.DecoderStack.__call__

    def counted(self: Any, x: torch.Tensor, rope: Any, attend: Any, lora: Any = None) -> Any:
        stack_calls["with adapters"] += lora is not None
        return original(self, x, rope, attend, lora)

    monkeypatch.setattr(kernels.DecoderStack, "__call__", counted)
    ids = srv.stack.model.tokenizer.encode(PROMPTS[0])

    def run(model: str) -> list[int]:
        fields = {"model": model} if model else {}
        out = generate(srv, "acme", request(ids=ids, max_tokens=TOKENS, **fields), timeout=300)
        return [t for r in out if r.WhichOneof("event") == "chunk" for t in r.chunk.token_ids]

    names = ["", *ADAPTERS]
    with ThreadPoolExecutor(len(names)) as pool:
        served = dict(zip(names, pool.map(run, names), strict=True))
    # Alone, the q_proj/v_proj adapter's steps have no delta on o, gate_up or down.
    assert run("qv") == served["qv"]
    assert stack_calls["with adapters"] > 0, "no adapter row decoded in the native stack"
    assert served["qv"] != served[""] and served["all"] != served[""]
    for name, tokens in served.items():
        assert len(tokens) == TOKENS, name
        assert _oracle_agrees(merged[name], ids, tokens), name
