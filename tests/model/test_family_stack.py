"""Every family decodes through the native decoder stack: a tiny checkpoint of each, with its
4-bit packs (``--weights int4``), runs its all-decode steps in one native call per step
(biases, q/k norms, sandwich norms, GeGLU, a RoPE base per layer, query scaling, windows
and softcaps, experts with their router) and gives the greedy tokens of the layer loop,
logprobs within float32 rounding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from service.model import load_model
from service.model.native import kernels
from tests.fixtures import tiny_families as tf
from tests.model.test_families_gemma_moe import CHECKPOINTS
from tests.model.test_native_gemv import _add_greedy, _greedy_alone, _small_core, _spied_stack

WRITERS: dict[str, Callable[[Path], Path]] = {
    "qwen2_windowed": tf.write_qwen2_windowed,  # qkv bias, a sliding layer
    "qwen3": lambda d: tf.write_tiny(d, "qwen3", head_dim=32, seed=31),  # q/k norms
    "llama_biased": tf.write_llama_biased,  # q/k/v, o and gate/up/down biases
    "phi3": tf.write_phi3,
    # sandwich norms, GeGLU, query_pre_attn_scalar, two RoPE bases, a window
    "gemma3_text": lambda d: tf.write_tiny(d, "gemma3_text", **CHECKPOINTS["gemma3_text"]),
    # the same with an attention softcap (kvcache's) and a final one
    "gemma2": lambda d: tf.write_tiny(d, "gemma2", **CHECKPOINTS["gemma2"]),
    # top-2 of 4 experts, renormalised, a window
    "mixtral": lambda d: tf.write_tiny(d, "mixtral", **CHECKPOINTS["mixtral"]),
    # top-2 of 4 experts, not renormalised, q/k norms; an expert width the 4-bit packs take
    "qwen3_moe": lambda d: tf.write_tiny(
        d, "qwen3_moe", **{**CHECKPOINTS["qwen3_moe"], "moe_intermediate_size": 64}
    ),
}

Out = list[tuple[int, float]]


def _decode(lm: Any, stack: Any) -> list[Out]:
    """Three greedy requests, the third arriving beside the first two's decodes, through a
    thread-free core; the model's decode steps on ``stack`` (None: the layer loop)."""
    from service.engine.types import Delta, EngineEvent

    lm.model.use_stack(stack)
    core = _small_core(lm)
    got: list[Out] = [[], [], []]

    def add(i: int, prompt: int, n: int) -> None:
        def sink(event: EngineEvent, out: Out = got[i]) -> None:
            if isinstance(event, Delta):
                out.extend((lp.token_id, lp.logprob) for lp in event.logprobs)

        _add_greedy(core, i, 5, prompt, n, 1, sink)

    add(0, 2 * tf.WINDOW + 3, 10)  # longer than the window: the sliding layers cut it
    add(1, 5, 8)
    with torch.inference_mode():
        core.step()
        core.step()
        add(2, 6, 6)
        while core.has_work():
            core.step()
    return got


@pytest.mark.parametrize("name", list(WRITERS))
def test_each_family_decodes_through_the_stack_as_the_layer_loop(name: str, tmp_path: Path) -> None:
    lm, stack, rows, spy = _spied_stack(WRITERS[name](tmp_path / name), "int4")
    try:
        loop = _decode(lm, None)
        assert not rows
        native = _decode(lm, spy)
    finally:
        lm.model.use_stack(stack)
    assert [len(g) for g in loop] == [10, 8, 6]
    assert rows and max(rows) >= 2  # decode steps of several rows ran in the stack
    assert [[t for t, _ in g] for g in native] == [[t for t, _ in g] for g in loop]
    for g, w in zip(native, loop, strict=True):
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w, strict=True)) < 1e-3


def test_what_the_stack_adds_is_what_changes_its_output(tmp_path: Path) -> None:
    """Each family piece the stack computes is read: Gemma 3's tokens through the stack
    change when its post-norms, its GeGLU or its query scale are taken away from the stack
    alone (the layer loop it matched keeps them)."""
    path = WRITERS["gemma3_text"](tmp_path / "gemma3")
    lm = load_model(path, dtype="float32", weights="int4", progress=False, batch_invariant="off")
    stack = lm.model.stack
    assert isinstance(stack, kernels.DecoderStack)
    want = _decode(lm, stack)
    c = lm.model.config
    layers = stack.layers
    hq, hkv, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    variants = {
        "post-norms": kernels.DecoderStack(
            [replace(x, post_attn_norm=None, post_mlp_norm=None) for x in layers],
            hq, hkv, d, eps, c.activation, c.query_scale,
        ),
        "gelu": kernels.DecoderStack(layers, hq, hkv, d, eps, "silu", c.query_scale),
        "query scale": kernels.DecoderStack(layers, hq, hkv, d, eps, c.activation, 1.0),
        "q/k norms": kernels.DecoderStack(
            [replace(x, qk_norm=None) for x in layers], hq, hkv, d, eps, c.activation,
            c.query_scale,
        ),
    }  # fmt: skip
    try:
        for piece, other in variants.items():
            got = _decode(lm, other)
            assert got != want, piece
    finally:
        lm.model.use_stack(stack)


def test_experts_whose_width_the_4_bit_packs_do_not_take_keep_the_layer_loop(
    tmp_path: Path,
) -> None:
    """Qwen3-MoE's tiny expert width of 48 is not whole blocks of 32: its experts stay dense
    and its steps run the layer loop."""
    path = tf.write_tiny(tmp_path / "qwen3_moe", "qwen3_moe", **CHECKPOINTS["qwen3_moe"])
    lm = load_model(path, dtype="float32", weights="int4", progress=False, batch_invariant="off")
    packed = lm.model.packed
    assert packed is not None and packed.experts_gate_up == (None, None)
    assert lm.model.stack is None


def test_the_stack_routes_each_row_as_the_family_does(tmp_path: Path) -> None:
    """The stack reads its routing: Mixtral's tokens through the stack change when its
    top-k weights are not renormalised, or when each row takes one expert instead of two
    (the layer loop it matched keeps both)."""
    path = WRITERS["mixtral"](tmp_path / "mixtral")
    lm = load_model(path, dtype="float32", weights="int4", progress=False, batch_invariant="off")
    stack = lm.model.stack
    assert isinstance(stack, kernels.DecoderStack)
    want = _decode(lm, stack)
    c = lm.model.config
    hq, hkv, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps

    def routed(**change: Any) -> kernels.DecoderStack:
        layers = [
            replace(x, experts=replace(x.experts, **change)) if x.experts else x
            for x in stack.layers
        ]
        return kernels.DecoderStack(layers, hq, hkv, d, eps, c.activation, c.query_scale)

    try:
        for piece, other in {
            "renormalised": routed(normalize=False),
            "top-2": routed(top_k=1),
        }.items():
            assert _decode(lm, other) != want, piece
    finally:
        lm.model.use_stack(stack)


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "mixtral"])
def test_the_families_run_batch_invariant(name: str, tmp_path: Path) -> None:
    """With every layer on the stack, these families load ``--batch-invariant on``: a
    request's logprobs are the same bits alone and beside others."""
    path = WRITERS[name](tmp_path / name)
    lm = load_model(path, dtype="float32", weights="int4", progress=False, batch_invariant="on")
    assert lm.batch_invariant
    together = _decode(lm, lm.model.stack)
    assert _greedy_alone(lm, 1, 5, 5, 8) == together[1]
