"""A step whose plan the C decode kernel refuses fails that step's requests with an error,
and the engine goes on serving the next ones (tiny model, real kernel, threaded engine)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcache import CacheConfig
from kvcache.backends import cpu_decode
from kvcache.errors import KernelRefused
from service.engine import EngineConfig, Finished, build_engine
from service.engine.types import Delta, EngineEvent
from service.model import LoadedModel
from tests.engine.conftest import Recorder, assert_at_baseline, make_core, prompt_ids, req, run_all

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def _one_layer_past(indices: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
    """The plan's pages moved one layer on: what a bug upstream of the kernel would send."""
    return indices + kv_layer.shape[0]


def test_a_refused_plan_fails_its_requests_and_the_engine_keeps_serving(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cpu_decode.kernel() is not None, "a C compiler is here: the kernel must build"
    armed = {"on": False}
    refusals: list[str] = []
    original_run = cpu_decode.DecodeKernel.run
    original_writer = cpu_decode.DecodeKernel.layer_writer

    def counted(call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            try:
                return call(*args)
            except KernelRefused as err:
                refusals.append(str(err))
                raise

        return wrapped

    def run(self: Any, q: Any, kv_layer: Any, indptr: Any, indices: Any, lens: Any) -> Any:
        if armed["on"]:
            indices = _one_layer_past(indices, kv_layer)
        return counted(original_run)(self, q, kv_layer, indptr, indices, lens)

    def layer_writer(self: Any, q: Any, k: Any, v: Any, kv_layer: Any, rows: Any, indptr: Any,
                     indices: Any, lens: Any) -> Any:
        if armed["on"]:
            indices = _one_layer_past(indices, kv_layer)
        return counted(original_writer)(self, q, k, v, kv_layer, rows, indptr, indices, lens)

    monkeypatch.setattr(cpu_decode.DecodeKernel, "run", run)
    monkeypatch.setattr(cpu_decode.DecodeKernel, "layer_writer", layer_writer)

    good = req("good", prompt_ids(3, 12, 384), max_tokens=6)
    reference = Recorder()
    run_all(make_core(tiny), reference, [good])
    engine = build_engine(tiny, EngineConfig(warmup=False), CacheConfig(page_size=16), kv_pages=64)
    engine.start()
    try:

        async def collect(r: Any) -> list[EngineEvent]:
            return [e async for e in await engine.submit(r)]

        armed["on"] = True
        bad = asyncio.run(collect(req("bad", prompt_ids(4, 12, 384), max_tokens=6)))
        armed["on"] = False
        assert refusals and all("page index outside the pool" in r for r in refusals)
        finished = bad[-1]
        assert isinstance(finished, Finished) and finished.reason == "error"
        served = asyncio.run(collect(good))
        assert isinstance(served[-1], Finished) and served[-1].reason != "error"
        deltas = [e for e in served[1:-1] if isinstance(e, Delta)]
        assert len(deltas) == len(served) - 2
        tokens = [t for e in deltas for t in e.token_ids]
        assert tokens == reference.tokens("good")
        assert_at_baseline(asyncio.run(engine.stats()))
    finally:
        engine.shutdown()
