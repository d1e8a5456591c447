"""Paged torch attention == dense reference, for scattered page layouts, GQA, mixed steps."""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable, Sequence

import pytest
import torch

from kvcache import CacheConfig, KVCacheManager, PagePool, StepEntry, write_kv
from kvcache.attention import NativeAttend
from kvcache.backends import cpu_decode, torch_backend
from kvcache.dense import DenseAttention, causal_attention
from kvcache.metadata import kv_rows
from kvcache.step import StepAttention

from .helpers import SECRET, FakeClock, attn_of, grow

HEAD_DIM = 8


def _scatter_free_list(mgr: KVCacheManager, rng: random.Random) -> None:
    """Allocate and free filler sequences so later pages come from a shuffled free list."""
    ids = [f"filler{i}" for i in range(6)]
    for i, sid in enumerate(ids):
        mgr.open(sid, "filler", [1], use_prefix_cache=False)
        grow(mgr, sid, rng.randint(1, 3) * mgr.page_size + i)
    rng.shuffle(ids)
    for sid in ids:
        mgr.free(sid)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (6, 2), (9, 3), (4, 1)])
@pytest.mark.parametrize("gather_bytes", [None, 1], ids=["one-chunk", "chunk-per-seq"])
@pytest.mark.parametrize("decode_path", ["sdpa", "matmul"])
def test_paged_matches_dense_for_mixed_batches(
    page_size: int,
    hq: int,
    hkv: int,
    gather_bytes: int | None,
    decode_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if gather_bytes is not None:  # split decode batches into one SDPA call per sequence
        monkeypatch.setattr(torch_backend, "_CPU_GATHER_BYTES", gather_bytes)
    if decode_path == "matmul":  # the bf16/fp16 decode path, exercised here in fp32
        monkeypatch.setattr(torch_backend, "_MATMUL_DECODE", (torch.float32,))
    rng = random.Random(page_size * 100 + hq * 10 + hkv)
    torch.manual_seed(rng.randint(0, 10**6))
    num_layers = 2
    pool = PagePool(num_layers, 160 if page_size == 16 else 400, page_size, hkv, HEAD_DIM)
    mgr = KVCacheManager(pool, CacheConfig(page_size=page_size, secret=SECRET), FakeClock())
    _scatter_free_list(mgr, rng)

    lengths = {"s0": 37, "s1": 21, "s2": 5, "s3": 50}
    q = {s: torch.randn(num_layers, n, hq, HEAD_DIM) for s, n in lengths.items()}
    k = {s: torch.randn(num_layers, n, hkv, HEAD_DIM) for s, n in lengths.items()}
    v = {s: torch.randn(num_layers, n, hkv, HEAD_DIM) for s, n in lengths.items()}
    for s, n in lengths.items():
        mgr.open(s, f"tenant-{s}", list(range(n)), use_prefix_cache=False)
    done = dict.fromkeys(lengths, 0)
    # Each step mixes prefill chunks of varied sizes with one-token decodes.
    chunk_plan = {"s0": [7, 13, 1, 1, 15], "s1": [20, 1], "s2": [1, 1, 3], "s3": [16, 16, 1, 17]}
    worst = 0.0
    while any(chunk_plan.values()):
        entries = []
        for s in rng.sample(sorted(lengths), len(lengths)):
            if chunk_plan[s]:
                n = chunk_plan[s].pop(0)
                grow(mgr, s, done[s] + n)
                entries.append(StepEntry(s, done[s], n))
        step = attn_of(mgr, entries)
        for layer in range(num_layers):
            qs = torch.cat(
                [q[e.seq_id][layer, e.num_computed : e.num_computed + e.num_new] for e in entries]
            )
            ks = torch.cat(
                [k[e.seq_id][layer, e.num_computed : e.num_computed + e.num_new] for e in entries]
            )
            vs = torch.cat(
                [v[e.seq_id][layer, e.num_computed : e.num_computed + e.num_new] for e in entries]
            )
            out = step(layer, qs, ks, vs)
            row = 0
            for e in entries:
                end = e.num_computed + e.num_new
                ref = causal_attention(
                    q[e.seq_id][layer, e.num_computed : end],
                    k[e.seq_id][layer, :end],
                    v[e.seq_id][layer, :end],
                    e.num_computed,
                )
                got = out[row : row + e.num_new]
                worst = max(worst, (got - ref).abs().max().item())
                row += e.num_new
        for e in entries:
            done[e.seq_id] += e.num_new
            mgr.commit(e.seq_id, range(lengths[e.seq_id]), done[e.seq_id])
    assert done == {"s0": 37, "s1": 21, "s2": 5, "s3": 50}
    assert worst <= 1e-5


def test_decode_only_batch_matches_dense() -> None:
    torch.manual_seed(0)
    pool = PagePool(1, 64, 4, 2, HEAD_DIM)
    mgr = KVCacheManager(pool, CacheConfig(page_size=4, secret=SECRET), FakeClock())
    dense = {s: DenseAttention(1) for s in ("a", "b", "c")}
    lens = {"a": 9, "b": 2, "c": 17}
    for s, n in lens.items():
        mgr.open(s, "t", list(range(n + 3)), use_prefix_cache=False)
        grow(mgr, s, n)
        qkv = [torch.randn(n, h, HEAD_DIM) for h in (4, 2, 2)]
        attn_of(mgr, [StepEntry(s, 0, n)])(0, *qkv)
        dense[s](0, *qkv)
        mgr.commit(s, range(n + 3), n)
    for _ in range(3):
        entries = []
        for s in ("c", "a", "b"):
            grow(mgr, s, lens[s] + 1)
            entries.append(StepEntry(s, lens[s], 1))
        q, k, v = (
            torch.randn(3, 4, HEAD_DIM),
            torch.randn(3, 2, HEAD_DIM),
            torch.randn(3, 2, HEAD_DIM),
        )
        out = attn_of(mgr, entries)(0, q, k, v)
        for i, e in enumerate(entries):
            ref = dense[e.seq_id](0, q[i : i + 1], k[i : i + 1], v[i : i + 1])
            torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=0)
            lens[e.seq_id] += 1
            mgr.commit(e.seq_id, range(lens[e.seq_id]), lens[e.seq_id])


def _decode_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pick one of the CPU bf16 decode paths: the C kernel, or the torch path's two."""
    if path == "c-kernel":
        assert cpu_decode.kernel() is not None, "a C compiler is here: the kernel must build"
        return
    monkeypatch.setattr(cpu_decode, "kernel", lambda: None)
    monkeypatch.setattr(torch_backend, "_CPU_UPCAST_DECODE_KEYS", 0 if path == "bf16" else 10**6)


DECODE_PATHS = ["c-kernel", "bf16", "float32-upcast"]


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_bf16_decode_matches_float32_dense(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 decode of sequences of different lengths (padded, masked) on every CPU path:
    within bf16 rounding of float32 attention over the same bf16 K/V."""
    _decode_path(path, monkeypatch)
    torch.manual_seed(3)
    hq, hkv = 6, 2
    pool = PagePool(1, 64, 4, hkv, HEAD_DIM, dtype=torch.bfloat16)
    mgr = KVCacheManager(pool, CacheConfig(page_size=4, secret=SECRET), FakeClock())
    lens = {"a": 9, "b": 2, "c": 17}
    keys = {}
    for s, n in lens.items():
        mgr.open(s, "t", list(range(n + 1)), use_prefix_cache=False)
        grow(mgr, s, n)
        kv = [torch.randn(n, hkv, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
        attn_of(mgr, [StepEntry(s, 0, n)])(0, torch.randn(n, hq, HEAD_DIM).bfloat16(), *kv)
        mgr.commit(s, range(n + 1), n)
        keys[s] = kv
    entries = []
    for s in ("c", "a", "b"):
        grow(mgr, s, lens[s] + 1)
        entries.append(StepEntry(s, lens[s], 1))
    q, k, v = (torch.randn(3, h, HEAD_DIM, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    out = attn_of(mgr, entries)(0, q, k, v)
    assert out.dtype == torch.bfloat16
    for i, e in enumerate(entries):
        full_k = torch.cat([keys[e.seq_id][0], k[i : i + 1]]).float()
        full_v = torch.cat([keys[e.seq_id][1], v[i : i + 1]]).float()
        ref = causal_attention(q[i : i + 1].float(), full_k, full_v, lens[e.seq_id])
        torch.testing.assert_close(out[i : i + 1].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_attention_reads_only_own_pages(dtype: torch.dtype) -> None:
    """Poisoning every page outside a sequence's table does not change its output (bf16
    decode runs the C kernel where it builds)."""
    torch.manual_seed(1)
    pool = PagePool(1, 32, 4, 1, HEAD_DIM, dtype=dtype)
    mgr = KVCacheManager(pool, CacheConfig(page_size=4, secret=SECRET), FakeClock())
    mgr.open("mine", "a", list(range(10)), use_prefix_cache=False)
    mgr.open("other", "b", list(range(10)), use_prefix_cache=False)
    for s in ("mine", "other"):
        grow(mgr, s, 6)
        qkv = [torch.randn(6, 1, HEAD_DIM, dtype=dtype) for _ in range(3)]
        attn_of(mgr, [StepEntry(s, 0, 6)])(0, *qkv)
        mgr.commit(s, range(10), 6)
    own = {r.page_id for r in mgr.sequence_pages("mine")}
    q, k, v = (torch.randn(1, 1, HEAD_DIM, dtype=dtype) for _ in range(3))
    grow(mgr, "mine", 7)
    before = attn_of(mgr, [StepEntry("mine", 6, 1)])(0, q, k, v)
    for page in range(32):
        if page not in own:
            pool.kv[0, page] = float("nan")
    after = attn_of(mgr, [StepEntry("mine", 6, 1)])(0, q, k, v)
    assert torch.isfinite(after).all()
    assert torch.equal(before, after)


def test_write_kv_places_tokens_in_slots() -> None:
    kv = torch.zeros(3, 2, 4, 1, 2)
    k = torch.tensor([[[1.0, 1.0]], [[2.0, 2.0]]])
    write_kv(kv, k, -k, torch.tensor([5, 8]))
    assert torch.equal(kv[1, 0, 1], k[0]) and torch.equal(kv[1, 1, 1], -k[0])
    assert torch.equal(kv[2, 0, 0], k[1]) and torch.equal(kv[2, 1, 0], -k[1])
    assert int((kv != 0).sum()) == 8


def _three_decoding(
    dtype: torch.dtype,
    seed: int,
    on_prefill: Callable[[StepAttention], None] | None = None,
    pool_dtype: torch.dtype | None = None,
) -> tuple[PagePool, KVCacheManager, dict[str, int], list[StepEntry], StepAttention]:
    """Three sequences (9, 2 and 6 tokens) prefilled over 2 layers of a 4-token-page pool (of
    ``pool_dtype``, default ``dtype``: q, k and v's), then the step that decodes one token of
    each: (pool, manager, lengths, entries, that step)."""
    torch.manual_seed(seed)
    pool = PagePool(2, 32, 4, 3, HEAD_DIM, dtype=pool_dtype or dtype)
    mgr = KVCacheManager(pool, CacheConfig(page_size=4, secret=SECRET), FakeClock())
    lens = {"a": 9, "b": 2, "c": 6}
    for s, n in lens.items():
        mgr.open(s, "t", list(range(n + 2)), use_prefix_cache=False)
        grow(mgr, s, n)
        step = attn_of(mgr, [StepEntry(s, 0, n)])
        if on_prefill is not None:
            on_prefill(step)
        for layer in range(2):
            step(layer, *(torch.randn(n, h, HEAD_DIM, dtype=dtype) for h in (9, 3, 3)))
        mgr.commit(s, range(n + 2), n)
    entries = []
    for s in ("c", "a", "b"):
        grow(mgr, s, lens[s] + 1)
        entries.append(StepEntry(s, lens[s], 1))
    return pool, mgr, lens, entries, attn_of(mgr, entries)


_ATTEND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 4)


def _two_layers(step: StepAttention, plan: NativeAttend, native: bool) -> list[torch.Tensor]:
    """Both layers' attention of fresh float32 q, k, v for every token of ``step``: through
    ``plan``'s C function (``native``), else through ``step`` itself."""
    t = step.metadata.num_tokens
    outs = []
    for layer in range(2):
        q, k, v = (torch.randn(t, h, HEAD_DIM) for h in (9, 3, 3))
        if native:
            out = torch.empty_like(q)
            status = _ATTEND(plan.fn)(
                plan.ctx, layer, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
            )
            assert status == 0
        else:
            out = step(layer, q, k, v)
        outs.append(out)
    return outs


def _then_a_prompt(
    mgr: KVCacheManager, lens: dict[str, int], entries: Sequence[StepEntry], prompt: int, chunk: int
) -> None:
    """After a decode step of ``entries``: their tokens are committed, a new sequence "d" of
    ``prompt`` tokens gets pages for its first ``chunk``, and "a" for its next token."""
    for s in entries:
        lens[s.seq_id] += 1
        mgr.commit(s.seq_id, range(lens[s.seq_id] + 1), lens[s.seq_id])
    mgr.open("d", "t", list(range(prompt)), use_prefix_cache=False)
    grow(mgr, "d", chunk)
    grow(mgr, "a", lens["a"] + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_all_decode_step_writes_and_attends_in_one_call_like_the_two(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An all-decode CPU step on the C kernel writes each layer's K/V and attends in one
    call (``TorchStep.write_attend``); the pool and the outputs are exactly those of the
    Python write then the kernel. A step with a prefill row takes the two-call path."""
    assert cpu_decode.kernel() is not None, "a C compiler is here: the kernel must build"
    calls: list[int] = []
    make = cpu_decode.DecodeKernel.layer_writer

    def counted(self: cpu_decode.DecodeKernel, *args: torch.Tensor) -> cpu_decode.LayerWriter:
        calls.append(1)
        return make(self, *args)

    monkeypatch.setattr(cpu_decode.DecodeKernel, "layer_writer", counted)

    def run(fused: bool) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        pool, mgr, lens, entries, step = _three_decoding(dtype, 5)
        calls.clear()
        if not fused:
            monkeypatch.setattr(step, "_write_attend", None)
        outs = [
            step(layer, *(torch.randn(3, h, HEAD_DIM, dtype=dtype) for h in (9, 3, 3)))
            for layer in range(2)
        ]
        decode_calls = len(calls)
        _then_a_prompt(mgr, lens, entries, prompt=4, chunk=3)
        mixed = attn_of(mgr, [StepEntry("d", 0, 3), StepEntry("a", lens["a"], 1)])
        mixed(0, *(torch.randn(4, h, HEAD_DIM, dtype=dtype) for h in (9, 3, 3)))
        assert len(calls) == decode_calls  # a prefill row: the Python write, then attention
        return outs, pool.kv.clone(), decode_calls

    fused_out, fused_pool, fused_calls = run(True)
    plain_out, plain_pool, plain_calls = run(False)
    assert (fused_calls, plain_calls) == (1, 0)  # checked once for the step's two layers
    assert torch.equal(fused_pool, plain_pool)
    for got, want in zip(fused_out, plain_out, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_native_attend_is_offered_for_float32_steps_and_matches_the_calls(
    pool_dtype: torch.dtype,
) -> None:
    """``StepAttention.native_attend`` (the step's attention for native model code, which
    computes float32) exists for steps on the C kernel over a float32 or bf16 pool; for an
    all-decode step, layer by layer through its C function, the pool and the outputs are
    exactly those of ``StepAttention(layer, q, k, v)``. A float16 pool has none."""
    from kvcache.errors import InvalidRequest

    assert cpu_decode.kernel() is not None, "a C compiler is here: the kernel must build"

    def prefill(step: StepAttention) -> None:
        plan = step.native_attend(9)  # each prefill token a row of its own
        assert plan is not None and plan.batch == step.metadata.num_tokens

    def run(native: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        pool, _, _, _, step = _three_decoding(torch.float32, 6, prefill, pool_dtype)
        plan = step.native_attend(9)
        assert plan is not None
        assert (plan.batch, plan.q_heads, plan.kv_heads, plan.head_dim, plan.num_layers) == (
            3, 9, 3, HEAD_DIM, 2,
        )
        with pytest.raises(InvalidRequest, match="query heads"):
            step.native_attend(8)
        return _two_layers(step, plan, native), pool.kv.clone()

    native_out, native_pool = run(True)
    plain_out, plain_pool = run(False)
    assert native_pool.dtype == pool_dtype
    assert torch.equal(native_pool, plain_pool)
    for got, want in zip(native_out, plain_out, strict=True):
        assert torch.equal(got, want)
    _, _, _, _, half = _three_decoding(torch.float16, 6)
    assert half.native_attend(9) is None


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_native_attend_gives_each_prefill_token_a_row_over_its_own_prefix(
    pool_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 step with prefill chunks is offered to native code as well, every token a
    kernel row attending causally over its own sequence's pages: through its C function the
    pool is written exactly as the per-layer calls write it, and the outputs agree with
    theirs (SDPA for the chunks) to float32 rounding, for a chunk from position 0 beside a
    decode row and for a chunk after computed tokens. The same holds over a bf16 pool
    (float32 compute with KV stored in bf16: each value rounded to nearest even as torch
    converts it, widened as it is read). Steps whose chunks would read more than
    ``_NATIVE_CHUNK_KEYS`` keys between them are left to the per-layer calls, unless the
    model asks for every chunk (``every_chunk``: batch-invariant steps)."""

    def layers(step: StepAttention, native: bool) -> list[torch.Tensor]:
        plan = step.native_attend(9)
        assert plan is not None and plan.batch == step.metadata.num_tokens
        return _two_layers(step, plan, native)

    def run(native: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        pool, mgr, lens, entries, step = _three_decoding(torch.float32, 8, None, pool_dtype)
        assert pool.kv.dtype == pool_dtype
        outs = layers(step, native)
        _then_a_prompt(mgr, lens, entries, prompt=9, chunk=5)
        outs += layers(attn_of(mgr, [StepEntry("a", lens["a"], 1), StepEntry("d", 0, 5)]), native)
        mgr.commit("d", range(9), 5)
        grow(mgr, "d", 8)
        outs += layers(attn_of(mgr, [StepEntry("d", 5, 3)]), native)
        return outs, pool.kv.clone()

    native_out, native_pool = run(True)
    plain_out, plain_pool = run(False)
    assert torch.equal(native_pool, plain_pool)
    for got, want in zip(native_out, plain_out, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(torch_backend, "_NATIVE_CHUNK_KEYS", 24)  # a 5-token chunk reads 25
    _, mgr, _, _, step = _three_decoding(torch.float32, 8)
    assert step.native_attend(9) is not None  # all decode: no chunk keys at all
    mgr.open("d", "t", list(range(9)), use_prefix_cache=False)
    grow(mgr, "d", 5)
    long_chunk = attn_of(mgr, [StepEntry("d", 0, 5)])
    assert long_chunk.native_attend(9) is None
    plan = long_chunk.native_attend(9, every_chunk=True)
    assert plan is not None and plan.batch == 5


def test_float32_queries_attend_over_a_bf16_pool_as_over_its_widened_copy() -> None:
    """``DecodeKernel.run`` and ``layer_writer`` take float32 q (and k, v) over a bf16 pool:
    k and v are stored rounded to bf16 (nearest even, as torch converts them) and the
    result, float32, is the float32 kernel's over the pool widened to float32; a step of the
    per-layer path over such a pool agrees with it too."""
    kernel = cpu_decode.kernel()
    assert kernel is not None, "a C compiler is here: the kernel must build"
    pool, _, _, _, step = _three_decoding(torch.float32, 9, None, torch.bfloat16)
    meta = step.metadata
    paged = (
        meta.kv_indptr,
        meta.kv_indices,
        torch.tensor(meta.kv_lens, dtype=torch.int32),
    )
    q = torch.randn(3, 9, HEAD_DIM)
    layer = pool.kv[0]
    got = kernel.run(q, layer, *paged)
    assert got.dtype == torch.float32
    want = kernel.run(q, layer.float().contiguous(), *paged)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    k, v = torch.randn(3, 3, HEAD_DIM), torch.randn(3, 3, HEAD_DIM)
    rows = kv_rows(meta.slot_mapping, layer.shape[2])
    wide = layer.float().contiguous()
    out = kernel.layer_writer(q, k, v, layer, rows, *paged)(q, k, v, layer)
    flat = layer.view(-1, 3, HEAD_DIM)
    assert torch.equal(flat[rows[0]], k.bfloat16()) and torch.equal(flat[rows[1]], v.bfloat16())
    wide.view(-1, 3, HEAD_DIM)[rows[0]] = k.bfloat16().float()
    wide.view(-1, 3, HEAD_DIM)[rows[1]] = v.bfloat16().float()
    torch.testing.assert_close(out, kernel.run(q, wide, *paged), rtol=1e-6, atol=1e-6)
    # the per-layer path (the Python write, then the kernel) over the same kind of pool
    _, _, _, _, again = _three_decoding(torch.float32, 9, None, torch.bfloat16)
    plain = again(0, q, k, v)
    torch.testing.assert_close(plain, out, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="does not take"):
        kernel.run(q.bfloat16(), wide, *paged)  # bf16 queries over a float32 pool
