"""LoRA deltas inside the native decoder stack (``kvf_decoder_stack`` with its LoRA table):
a decode step with adapter rows stays one native call and computes what the layer loop's
per-adapter torch matmuls compute, and its base rows are bit for bit a base-only step's."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvcache.attention import NativeAttend
from kvcache.backends import cpu_decode
from kvcache.metadata import kv_rows
from service.model import LoadedModel, load_model
from service.model.lora import TARGETS, LoraAdapter, LoraGroup, load_lora
from service.model.lora_batch import LoraBatch
from service.model.lora_stack import LoraStacks
from service.model.native import kernels

# Each test loads the default model (~20-30 s on 2 cores).
pytestmark = pytest.mark.slow

POSITIONS = (3, 9, 14, 6, 12)  # one decode token per sequence, each on its own page
_ATTEND = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p, ctypes.c_void_p,
)  # fmt: skip


def write_adapter(
    directory: Path,
    lm: LoadedModel,
    rank: int,
    seed: int,
    targets: tuple[str, ...] = TARGETS,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A PEFT LoRA directory with random A and B (std 0.02, alpha 2 * rank) for ``targets``,
    saved in ``dtype``."""
    c = lm.model.config
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for module in targets:
            out, inp = shapes[module]
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=gen) * 0.02).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=gen) * 0.02).to(dtype)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "bias": "none"}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def auto_model(default_model_path: Path) -> LoadedModel:
    """The default model as ``serve`` runs it in float32: decode steps on the native stack."""
    lm = load_model(
        default_model_path, dtype="float32", weights="auto", progress=False, batch_invariant="off"
    )
    assert isinstance(lm.model.stack, kernels.DecoderStack)
    return lm


@pytest.fixture(scope="module")
def adapters(auto_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> list[LoraAdapter]:
    """Rank 8 and rank 64 on all seven projections, and rank 8 on q, v and down only (its
    o and gate_up groups, and k's rows of qkv, get no delta)."""
    root = tmp_path_factory.mktemp("adapters")
    c = auto_model.model.config
    specs = [("a", 8, TARGETS), ("b", 64, TARGETS), ("c", 8, ("q_proj", "v_proj", "down_proj"))]
    return [
        load_lora(name, write_adapter(root / name, auto_model, rank, seed, targets), c, torch.float32, 64)
        for seed, (name, rank, targets) in enumerate(specs)
    ]


class _PoolAttention:
    """kvcache's C decode attention for ``len(POSITIONS)`` sequences over a fresh copy of one
    random pool, offered both ways: as the layer loop's ``AttentionFn`` and as the native
    stack's :class:`NativeAttend`; both paths then attend with the same code."""

    def __init__(self, lm: LoadedModel) -> None:
        c = lm.model.config
        decode = cpu_decode.kernel()
        assert decode is not None
        n = len(POSITIONS)
        gen = torch.Generator().manual_seed(7)
        self.pool = torch.randn(c.num_layers, n, 2, 16, c.num_kv_heads, c.head_dim, generator=gen)
        positions = torch.tensor(POSITIONS)
        self.plan = decode.step_context(
            c.num_heads,
            self.pool,
            kv_rows(torch.arange(n) * 16 + positions, 16),
            torch.arange(n + 1, dtype=torch.int32),
            torch.arange(n, dtype=torch.int32),
            (positions + 1).to(torch.int32),
        )
        self._fn = _ATTEND(self.plan.fn)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        assert self._fn(self.plan.ctx, layer, *ptrs) == 0
        return out

    def native_attend(self, q_heads: int, invariant: bool = False) -> NativeAttend:
        return self.plan


def _logits(
    lm: LoadedModel, lora: LoraBatch | None, calls: list[bool], stacked: bool = True
) -> torch.Tensor:
    """One all-decode step's logits; ``calls`` gets, per native stack call, whether it
    carried LoRA deltas (nothing when the layer loop ran the step)."""
    model = lm.model
    stack = model.stack
    assert stack is not None

    def spy(
        x: torch.Tensor,
        rope: torch.Tensor,
        attend: NativeAttend,
        deltas: Mapping[str, kernels.StackDelta] | None = None,
    ) -> torch.Tensor:
        calls.append(deltas is not None)
        return stack(x, rope, attend, deltas)

    ids = torch.tensor([100 + 37 * i for i in range(len(POSITIONS))])
    model.use_stack(spy)
    try:
        return model(ids, torch.tensor(POSITIONS), _PoolAttention(lm), None, lora)
    finally:
        model.use_stack(stack)


def _rows(adapters: list[LoraAdapter]) -> list[LoraAdapter | None]:
    a, b, c = adapters
    return [a, None, b, c, b]


def test_a_mixed_adapter_step_runs_in_the_stack_as_the_layer_loop_computes_it(
    auto_model: LoadedModel, adapters: list[LoraAdapter]
) -> None:
    """Rows of three adapters (rank 8 and 64, all seven projections, and one on three) and a
    base row in one decode step: the native stack with the stacked, masked deltas gives the
    layer loop's logits (per-adapter torch matmul pairs, no masks) within the rounding of
    the GEMV inputs (:func:`_mean_gaps`); the base row is bit for bit a base-only step's;
    and each adapter row moves far from its base logits."""
    cpu = torch.device("cpu")
    rows = _rows(adapters)
    calls: list[bool] = []
    loop = LoraBatch.of_rows(rows, cpu)  # segments: the stack cannot take them
    assert loop is not None and loop.stack_deltas(len(rows)) is None
    want = _logits(auto_model, loop, calls)
    assert calls == []
    batch = LoraBatch.of_rows(rows, cpu, LoraStacks())
    assert batch is not None
    got = _logits(auto_model, batch, calls)
    assert calls == [True]
    base = _logits(auto_model, None, calls)
    assert calls == [True, False]
    assert torch.equal(got[1], base[1])
    assert all(d > 0.5 for d in _mean_gaps(got, base)[[0, 2, 3, 4]])
    assert all(d < 0.1 for d in _mean_gaps(got, want)), _mean_gaps(got, want)


def _mean_gaps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row, the mean absolute difference of two steps' logits.
    NOTE: measured on the default model with these adapters: the stack and the layer loop
    differ by 0.004-0.02 a row (the loop's unfused norm rounds each GEMV's int16 input
    differently, and 30 layers amplify it; the loop's own stacked and segment forms differ
    as much), while leaving out any one projection's delta moves a row it touches by
    0.55-23 and the adapters move their rows by 1.2-12."""
    return (got - want).abs().mean(dim=-1)


def test_one_adapter_on_every_row_runs_in_the_stack(
    auto_model: LoadedModel, adapters: list[LoraAdapter]
) -> None:
    """A step whose rows all use one adapter (its own weights, a mask of ones) runs in the
    stack and gives the layer loop's logits."""
    cpu = torch.device("cpu")
    batch = LoraBatch.of_rows([adapters[1]] * len(POSITIONS), cpu, LoraStacks())
    assert batch is not None and batch.plans["qkv"].rows is None
    calls: list[bool] = []
    got = _logits(auto_model, batch, calls)
    assert calls == [True]
    stack = _stack_of(auto_model)
    auto_model.model.use_stack(None)
    try:
        want = auto_model.model(
            torch.tensor([100 + 37 * i for i in range(len(POSITIONS))]),
            torch.tensor(POSITIONS), _PoolAttention(auto_model), None, batch,
        )  # fmt: skip
    finally:
        auto_model.model.use_stack(stack)
    assert all(d < 0.1 for d in _mean_gaps(got, want)), _mean_gaps(got, want)


@pytest.mark.parametrize("saved", [torch.bfloat16, torch.float16])
def test_a_half_precision_adapter_is_held_so_and_computes_exactly_its_float32_copy(
    auto_model: LoadedModel, adapters: list[LoraAdapter], tmp_path: Path, saved: torch.dtype
) -> None:
    """An adapter saved in bfloat16 or float16 is held so (half the bytes) and widened
    exactly where read: a step with its rows (more of them than one pass over its weights
    takes, a float32 adapter and a base row beside them) gives bit for bit the logits of the
    same adapter held in float32. A float32 file's values that are not all one half type
    stay float32."""
    c = auto_model.model.config
    half = load_lora("h", write_adapter(tmp_path / "h", auto_model, 8, 5, dtype=saved),
                     c, torch.float32, 64)  # fmt: skip
    assert {g.a.dtype for g in half.groups.values()} == {saved}
    assert {g.b.dtype for g in half.groups.values()} == {saved}
    assert {g.a.dtype for g in adapters[0].groups.values()} == {torch.float32}
    wide = LoraAdapter(
        "w", half.digest, half.rank,
        {k: LoraGroup(g.a.float(), g.b.float(), g.scale) for k, g in half.groups.items()},
        2 * half.nbytes,
    )  # fmt: skip
    assert wide.nbytes == adapters[0].nbytes
    cpu = torch.device("cpu")
    base = _logits(auto_model, None, [])
    for rows in ([0] * len(POSITIONS), [0, None, 0, 1, 0]):
        got, want = (
            _logits(auto_model, LoraBatch.of_rows(
                [None if i is None else (held, adapters[0])[i] for i in rows], cpu, LoraStacks()
            ), [])
            for held in (half, wide)
        )  # fmt: skip
        assert torch.equal(got, want)
        on = [i for i, r in enumerate(rows) if r is not None]
        assert all(d > 0.5 for d in _mean_gaps(got, base)[on])
        assert all(torch.equal(got[i], base[i]) for i, r in enumerate(rows) if r is None)


def _stack_of(lm: LoadedModel) -> kernels.DecoderStack:
    stack = lm.model.stack
    assert isinstance(stack, kernels.DecoderStack)
    return stack



def test_the_stack_refuses_lora_deltas_it_does_not_take(
    auto_model: LoadedModel, adapters: list[LoraAdapter]
) -> None:
    """Every LoRA delta is checked against the stack's shapes before the native call (a
    ValueError, nothing written): unknown projections, a rank of 0, shapes of another
    projection or step, float64, non-contiguous, and a mask of the wrong rows."""
    stack = _stack_of(auto_model)
    batch = LoraBatch.of_rows(_rows(adapters), torch.device("cpu"), LoraStacks())
    assert batch is not None
    deltas = batch.stack_deltas(len(POSITIONS))
    assert deltas is not None and set(deltas) == set(kernels.LORA_GROUPS)
    qkv = deltas["qkv"]
    bad = [
        {"lm_head": qkv},
        {"o": qkv},
        {"qkv": kernels.StackDelta(qkv.a[:, :0], qkv.b[:, :0], qkv.mask[:, :0])},
        {"qkv": kernels.StackDelta(qkv.a.double(), qkv.b, qkv.mask)},
        {"qkv": kernels.StackDelta(qkv.a, qkv.b.transpose(1, 2).contiguous().transpose(1, 2), qkv.mask)},
        {"qkv": kernels.StackDelta(qkv.a, qkv.b, qkv.mask[:-1])},
        {"qkv": kernels.StackDelta(qkv.a[:-1], qkv.b[:-1], qkv.mask)},
    ]
    attn = _PoolAttention(auto_model)
    x = torch.randn(len(POSITIONS), auto_model.model.config.hidden_size)
    rope = auto_model.model.rope[torch.tensor(POSITIONS)]
    for deltas_ in bad:
        before = x.clone()
        with pytest.raises(ValueError, match="does not"):
            stack(x, rope, attn.plan, deltas_)
        assert torch.equal(x, before)
    assert not attn.pool.isnan().any()
