"""The native decoder stack honours sliding windows: kvcache's step context carries each
layer's window to the C attention it calls, so a windowed model decodes the same through
the stack as through the layer loop, and differently from the model without windows."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model.test_native_gemv import _add_greedy, _small_core, _spied_stack

pytestmark = pytest.mark.slow  # the default model, decoded three ways
WINDOW = 16


def _decode(lm: Any, windows: tuple[int, ...], stack: Any) -> list[list[tuple[int, float]]]:
    model = lm.model
    model.config = dataclasses.replace(model.config, layer_windows=windows)
    model.use_stack(stack)
    core = _small_core(lm)  # its pool takes the config's windows
    got: list[list[tuple[int, float]]] = [[], []]
    from service.engine.types import Delta, EngineEvent

    for i, (prompt, n) in enumerate(((3 * WINDOW, 8), (WINDOW // 2, 8))):

        def sink(event: EngineEvent, out: list[tuple[int, float]] = got[i]) -> None:
            if isinstance(event, Delta):
                out.extend((lp.token_id, lp.logprob) for lp in event.logprobs)

        _add_greedy(core, i, 300, prompt, n, 1, sink)
    with torch.inference_mode():
        while core.has_work():
            core.step()
    return got


def test_the_decoder_stack_decodes_a_windowed_model_as_the_layer_loop(
    default_model_path: Path,
) -> None:
    lm, stack, batches, spy = _spied_stack(default_model_path)
    config = lm.model.config
    windows = tuple(WINDOW if i % 2 else 0 for i in range(config.num_layers))
    try:
        loop = _decode(lm, windows, None)
        assert not batches
        native = _decode(lm, windows, spy)
        assert batches  # the decode steps ran through the stack
        full = _decode(lm, (), stack)
    finally:
        lm.model.config = config
        lm.model.use_stack(stack)
    assert native == loop
    assert [len(g) for g in native] == [8, 8]
    # the long prompt's decode reads past the window: without windows it is different
    assert native[0] != full[0]
