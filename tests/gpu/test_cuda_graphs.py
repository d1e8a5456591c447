"""Decode CUDA graphs: buckets, padding and static buffers on CPU (the same static-buffer
forward replayed eagerly), and real capture + replay on a GPU (marked ``cuda``)."""

from __future__ import annotations

import random

import pytest
import torch

from kvcache import KVCacheManager, StepAttention, StepEntry
from kvcache.backends.torch_backend import TorchBackend
from kvcache.backends.torch_graph import TorchGraphDecode
from kvcache.graph_step import pad_decode
from service.engine.cuda_graphs import DecodeGraphs, decode_buckets, pad_rows, pick_bucket
from service.engine.runner import BatchInputs, ModelRunner
from tests.kvcache.helpers import make_manager
from tools.gpu.models import Shape, random_llama
from tools.gpu.setup import make_cache, make_graphs

TINY = Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=97)


def test_buckets() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert decode_buckets(64)[-3:] == (32, 48, 64)
    with pytest.raises(ValueError):
        decode_buckets(0)
    assert pick_bucket(3, (1, 2, 4, 8)) == 4
    assert pick_bucket(8, (1, 2, 4, 8)) == 8
    assert pick_bucket(9, (1, 2, 4, 8)) is None
    assert pick_bucket(0, (1, 2, 4, 8)) is None


def test_pad_rows_repeats_the_first_row() -> None:
    out = torch.full((5,), -1)
    pad_rows(torch.tensor([7, 8, 9]), out)
    assert out.tolist() == [7, 8, 9, 7, 7]


def _decode_step(
    mgr_lens: dict[str, int], page_size: int = 4
) -> tuple[KVCacheManager, StepAttention]:
    mgr, _ = make_manager(num_pages=32, page_size=page_size)
    for s, n in mgr_lens.items():
        mgr.open(s, "t", list(range(n + 1)), use_prefix_cache=False)
        mgr.allocate_slots(s, n + 1)
        mgr.commit(s, range(n + 1), n)
    plan = mgr.begin_step([StepEntry(s, n, 1) for s, n in mgr_lens.items()])
    assert plan.attn is not None
    return mgr, plan.attn


def test_pad_decode_repeats_the_first_sequence_and_its_slot() -> None:
    _, step = _decode_step({"a": 5, "b": 9})
    meta = step.metadata
    padded = pad_decode(meta, 4)
    assert padded.batch_size == 4
    assert padded.page_ids == (
        meta.page_ids[0],
        meta.page_ids[1],
        meta.page_ids[0],
        meta.page_ids[0],
    )
    assert padded.kv_lens == (6, 10, 6, 6)
    slots = padded.slot_mapping.tolist()
    assert slots[:2] == meta.slot_mapping.tolist()
    assert slots[2:] == [slots[0], slots[0]]
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode(meta, 1)


def test_pad_decode_refuses_prefill_rows() -> None:
    mgr, _ = make_manager(num_pages=8)
    mgr.open("p", "t", list(range(6)), use_prefix_cache=False)
    mgr.allocate_slots("p", 6)
    step = mgr.begin_step([StepEntry("p", 0, 6)]).attn
    with pytest.raises(ValueError, match="decode"):
        pad_decode(step.metadata, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_torch_decode_matches_the_torch_backend(dtype: torch.dtype) -> None:
    lens = {"a": 3, "b": 17, "c": 8}
    mgr, step = _decode_step(lens)
    pool = mgr.pool
    pool.kv.copy_(torch.randn(pool.kv.shape))
    meta = pad_decode(step.metadata, 4)
    kernel = TorchGraphDecode(4, pool.num_kv_heads, 24, pool.device)
    kernel.update(meta)
    kv = pool.layer(1).to(dtype)
    q = torch.randn(4, 2, pool.head_dim, dtype=dtype)
    want = TorchBackend().prepare(meta)(q, kv)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel(q, kv).float(), want.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="capacity"):
        TorchGraphDecode(4, pool.num_kv_heads, 16, pool.device).update(meta)


def _graphs_vs_eager(device: str, backend: str, dtype: torch.dtype, shape: Shape = TINY) -> None:
    model = random_llama(shape, 256, dtype, torch.device(device), seed=3)
    graphed, graphed_backend = make_cache(model, backend, 4, 64)
    eager, _ = make_cache(model, backend, 4, 64)
    graphs = make_graphs(model, graphed, graphed_backend, (1, 4), 64)
    assert bool(graphed.pool.kv.eq(0).all())  # the capture's scratch writes are zeroed again
    rng = random.Random(0)
    prompts = {
        s: [rng.randrange(shape.vocab) for _ in range(n)]
        for s, n in (("a", 5), ("b", 11), ("c", 2))
    }
    last: dict[str, int] = {}
    seqs = {s: list(p) for s, p in prompts.items()}  # the caller owns the tokens
    for cache in (graphed, eager):
        for s, p in prompts.items():
            cache.open(s, "t", p, use_prefix_cache=False)
            cache.allocate_slots(s, len(p))
        step = cache.begin_step([StepEntry(s, 0, len(p)) for s, p in prompts.items()]).attn
        ids = torch.tensor([t for p in prompts.values() for t in p], device=device)
        pos = torch.tensor([i for p in prompts.values() for i in range(len(p))], device=device)
        ends = torch.tensor([4, 15, 17], device=device)
        assert graphs.run(BatchInputs(ids, pos, ends), step) is None  # prefill: eager only
        logits = model(ids, pos, step, ends)
        for (s, p), t in zip(prompts.items(), logits.argmax(-1).tolist(), strict=True):
            cache.commit(s, seqs[s], len(p))
            last[s] = t
    for s in prompts:
        seqs[s].append(last[s])
    lens = {s: len(p) for s, p in prompts.items()}
    for _ in range(4):
        outs = []
        for cache, use_graph in ((graphed, True), (eager, False)):
            for s in prompts:
                cache.allocate_slots(s, lens[s] + 1)
            step = cache.begin_step([StepEntry(s, lens[s], 1) for s in prompts]).attn
            inputs = BatchInputs(
                torch.tensor([last[s] for s in prompts], device=device),
                torch.tensor([lens[s] for s in prompts], device=device),
                torch.arange(3, device=device),
            )
            if use_graph:
                out = graphs.run(inputs, step)
                assert out is not None
            else:
                out = model(inputs.input_ids, inputs.positions, step, inputs.logits_indices)
            outs.append(out)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
        torch.testing.assert_close(graphed.pool.kv, eager.pool.kv, atol=tol, rtol=tol)
        for s, t in zip(prompts, outs[1].argmax(-1).tolist(), strict=True):
            lens[s] += 1
            last[s] = t
            for cache in (graphed, eager):
                cache.commit(s, seqs[s], lens[s])
            seqs[s].append(t)
    assert graphs.replays == 4


def test_graphs_replayed_eagerly_match_the_eager_forward_on_cpu() -> None:
    _graphs_vs_eager("cpu", "torch", torch.float32)


def test_graph_rejects_a_batch_larger_than_every_bucket() -> None:
    model = random_llama(TINY, 64, torch.float32, torch.device("cpu"))
    cache, backend = make_cache(model, "torch", 4, 32)
    graphs: DecodeGraphs = make_graphs(model, cache, backend, (1, 2), 16)
    for s in "abc":
        cache.open(s, "t", [1, 2], use_prefix_cache=False)
        cache.allocate_slots(s, 2)
        cache.commit(s, [1, 2], 1)
    step = cache.begin_step([StepEntry(s, 1, 1) for s in "abc"]).attn
    assert graphs.bucket_for(step) is None
    inputs = BatchInputs(torch.tensor([2, 2, 2]), torch.tensor([1, 1, 1]), torch.arange(3))
    assert graphs.run(inputs, step) is None
    assert graphs.replays == 0


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("torch", torch.float32), ("torch", torch.bfloat16), ("flashinfer", torch.bfloat16)],
)
def test_cuda_graph_capture_and_replay_match_eager(backend: str, dtype: torch.dtype) -> None:
    shape = TINY
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
        # FlashInfer's kernels are built for the usual head sizes: use the 8B model's.
        shape = Shape(
            hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=128, vocab=97
        )
    _graphs_vs_eager("cuda", backend, dtype, shape)


def test_model_runner_replays_decode_steps_and_runs_the_rest_eagerly() -> None:
    model = random_llama(TINY, 64, torch.float32, torch.device("cpu"), seed=1)
    cache, backend = make_cache(model, "torch", 4, 32)
    graphs = make_graphs(model, cache, backend, (1, 2), 16)
    runner = ModelRunner(model, torch.device("cpu"), graphs)
    eager = ModelRunner(model, torch.device("cpu"))
    cache.open("a", "t", [3, 4, 5], use_prefix_cache=False)
    cache.allocate_slots("a", 3)
    step = cache.begin_step([StepEntry("a", 0, 3)]).attn
    prefill = BatchInputs(torch.tensor([3, 4, 5]), torch.arange(3), torch.tensor([2]))
    runner.forward(prefill, step)
    assert graphs.replays == 0  # a prefill row: eager
    cache.commit("a", [3, 4, 5], 3)
    cache.allocate_slots("a", 4)
    step = cache.begin_step([StepEntry("a", 3, 1)]).attn
    decode = BatchInputs(torch.tensor([6]), torch.tensor([3]), torch.tensor([0]))
    got = runner.forward(decode, step)
    assert graphs.replays == 1
    torch.testing.assert_close(got, eager.forward(decode, step), atol=1e-5, rtol=1e-5)
