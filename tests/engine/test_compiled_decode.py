"""``--compile``: small decode batches through a torch.compile forward (service/engine/compiled.py).

A tiny bf16 Llama with int4-packed decode weights, compiled for buckets of 1 and 2
sequences: the compiled engine's greedy tokens equal the eager engine's, for one stream and
for two tenants' streams sharing a bucket, and the compiled forwards really served the
decode steps. Where the path cannot run, ``on`` refuses with the reason and ``auto`` runs
eagerly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.engine import compiled
from service.engine.types import EngineConfig
from service.model import LoadedModel, load_model
from tests.engine.conftest import Recorder, make_core, prompt_ids, req, run_all, untimed
from tests.fixtures.tiny_models import write_tiny_llama

CONFIG = EngineConfig(
    max_num_seqs=2, tuning=untimed(max_num_batched_tokens=256), max_model_len=256, warmup=False
)


@pytest.fixture(scope="module")
def packed_bf16(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = write_tiny_llama(Path(tmp_path_factory.mktemp("compiled")) / "llama", seed=3)
    return load_model(directory, dtype="bfloat16", weights="int4", progress=False)


def _skip_unless_compilable(loaded: LoadedModel) -> None:
    core = make_core(loaded, config=CONFIG)
    reason = compiled.unavailable_reason(loaded.model, core.pool)
    if reason is not None:
        pytest.skip(f"compiled decode cannot run here: {reason}")


def _generate(loaded: LoadedModel, mode: str) -> tuple[dict[str, list[int]], int]:
    core = make_core(loaded, config=CONFIG)
    with torch.inference_mode():
        graphs = compiled.attach(core, loaded.model, mode)
    vocab = loaded.model.config.vocab_size
    rec = Recorder()
    requests = [
        req("alone", prompt_ids(1, 21, vocab), tenant="a", max_tokens=24, ignore_eos=True),
        req("a2", prompt_ids(2, 9, vocab), tenant="a", max_tokens=30, ignore_eos=True),
        req("b1", prompt_ids(3, 40, vocab), tenant="b", max_tokens=30, ignore_eos=True),
    ]
    with torch.inference_mode():
        run_all(core, rec, requests[:1])  # one stream: bucket 1
        run_all(core, rec, requests[1:])  # two tenants' streams share bucket 2
    tokens = {r.request_id: rec.tokens(r.request_id) for r in requests}
    return tokens, 0 if graphs is None else graphs.replays


@pytest.mark.slow
def test_compiled_decode_matches_the_eager_engine(packed_bf16: LoadedModel) -> None:
    _skip_unless_compilable(packed_bf16)
    eager, no_replays = _generate(packed_bf16, "off")
    compiled_tokens, replays = _generate(packed_bf16, "on")
    assert no_replays == 0
    assert compiled_tokens == eager
    assert all(len(t) >= 24 for t in eager.values())
    # every decode step after each request's first token went through a compiled forward
    assert replays >= 23 + 29


def test_on_refuses_with_the_reason_and_auto_runs_eagerly(
    packed_bf16: LoadedModel, default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp32 = make_core(default_model, config=CONFIG)
    with pytest.raises(compiled.CompileUnavailable, match="needs bf16 compute"):
        compiled.attach(fp32, default_model.model, "on")
    assert compiled.attach(fp32, default_model.model, "auto") is None
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    core = make_core(packed_bf16, config=CONFIG)
    with pytest.raises(compiled.CompileUnavailable, match="no C\\+\\+ compiler"):
        compiled.attach(core, packed_bf16.model, "on")
    assert compiled.attach(core, packed_bf16.model, "auto") is None
    with pytest.raises(ValueError, match="unknown compile mode"):
        compiled.attach(core, packed_bf16.model, "sometimes")
    # the eager engine still serves
    rec = Recorder()
    with torch.inference_mode():
        run_all(core, rec, [req("r", [5, 6, 7], max_tokens=4, ignore_eos=True)])
    assert len(rec.tokens("r")) == 4


def test_compiling_needs_an_empty_pool(packed_bf16: LoadedModel) -> None:
    _skip_unless_compilable(packed_bf16)
    core = make_core(packed_bf16, config=CONFIG)
    core.add(req("held", [5, 6, 7], max_tokens=4), Recorder().sink("held"))
    with torch.inference_mode():
        core.step()
        with pytest.raises(RuntimeError, match="before any request holds a page"):
            compiled.attach(core, packed_bf16.model, "on")
