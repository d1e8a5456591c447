"""Structured outputs in the engine: the per-tenant compiled-grammar cache, and the token
mask inside the batched sampler (constrained and free rows in one step)."""

from __future__ import annotations

import pytest
import torch

from service.engine.sampler import Sampler, SampleRow
from service.engine.types import SamplingParams
from service.structured.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarLimits,
    GrammarSpec,
    Vocabulary,
    apply_grammar_masks,
)

EOS = 256  # one byte per token, then EOS


def _compiler(limits: GrammarLimits | None = None) -> GrammarCompiler:
    vocab = Vocabulary(
        token_bytes=[bytes([i]) for i in range(256)] + [b"<eos>"],
        eos_token_ids=(EOS,),
        bos_token_id=None,
        special_token_ids=(EOS,),
        encode=lambda text: list(text.encode("utf-8")),
    )
    return GrammarCompiler(vocab, limits or GrammarLimits())


def test_cache_is_per_tenant_and_bounded() -> None:
    gc = _compiler(GrammarLimits(cache_entries_per_tenant=2))
    spec = GrammarSpec("regex", "ab+")
    a1 = gc.compile("alice", spec)
    assert gc.compile("alice", spec) is a1  # a hit within the tenant
    assert gc.cached("alice") == 1 and gc.cached("bob") == 0
    b1 = gc.compile("bob", spec)
    assert b1 is not a1  # bob compiles his own: no cross-tenant hit
    gc.compile("alice", GrammarSpec("regex", "c"))
    gc.compile("alice", GrammarSpec("regex", "d"))
    assert gc.cached("alice") == 2
    assert gc.compile("alice", spec) is not a1  # evicted (LRU), compiled again
    gc.forget("bob")
    assert gc.cached("bob") == 0


def test_refusals_name_the_reason() -> None:
    gc = _compiler(GrammarLimits(max_source_bytes=100))
    with pytest.raises(GrammarError, match="limit is 100"):
        gc.compile("t", GrammarSpec("regex", "a" * 101))
    with pytest.raises(GrammarError, match="must not be empty"):
        gc.compile("t", GrammarSpec("lark", " "))
    with pytest.raises(GrammarError, match=r"unclosed group|regex"):
        gc.compile("t", GrammarSpec("regex", "a(b"))
    with pytest.raises(GrammarError, match="not a JSON object"):
        gc.compile("t", GrammarSpec("json_schema", "[1, 2"))
    assert gc.cached("t") == 0  # failures are not cached


def test_matcher_walks_the_grammar_to_completion() -> None:
    m = _compiler().compile("t", GrammarSpec("regex", "ab")).matcher()
    assert m.accept(ord("a")) and not m.finished
    assert m.accept(ord("b")) and m.finished
    other = _compiler().compile("t", GrammarSpec("regex", "ab")).matcher()
    assert not other.accept(ord("x"))  # refused


def test_mask_applies_only_to_constrained_rows_in_a_shared_step() -> None:
    gc = _compiler()
    matcher = gc.compile("t", GrammarSpec("regex", "[0-9]+")).matcher()
    vocab = 257
    logits = torch.zeros(2, vocab)
    logits[:, ord("z")] = 10.0  # both rows strongly prefer 'z'
    logits[:, ord("7")] = 1.0
    sampler = Sampler("cpu", seed=0)
    greedy = SamplingParams(temperature=0.0)
    rows = [
        SampleRow(greedy, None, [1], [], grammar=matcher),
        SampleRow(greedy, None, [1], []),
    ]
    out = sampler.sample(logits.clone(), rows)
    assert out.token_ids == [ord("7"), ord("z")]
    # Switched off (no grammar on row 0), both rows take 'z': the mask is what decides.
    free = [SampleRow(greedy, None, [1], []), SampleRow(greedy, None, [1], [])]
    assert sampler.sample(logits.clone(), free).token_ids == [ord("z"), ord("z")]


def test_sampled_rows_never_leave_the_grammar() -> None:
    gc = _compiler()
    compiled = gc.compile("t", GrammarSpec("regex", "(cat|dog)s?"))
    sampler = Sampler("cpu", seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        m = compiled.matcher()
        text = b""
        while not m.finished:
            logits = torch.randn(1, 257, generator=gen) * 5
            token = sampler.sample(logits, [SampleRow(SamplingParams(), None, [1], [], grammar=m)])
            t = token.token_ids[0]
            if t == EOS:
                break
            assert m.accept(t)
            text += bytes([t])
        assert text in (b"cat", b"cats", b"dog", b"dogs")


def test_mask_bits_map_to_token_ids() -> None:
    m = _compiler().compile("t", GrammarSpec("regex", "q")).matcher()
    logits = torch.zeros(1, 257)
    apply_grammar_masks(logits, [(0, m)])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed == [ord("q")]


def test_masks_touch_only_constrained_rows_each_with_its_own_grammar() -> None:
    compiler = _compiler()
    q = compiler.compile("t", GrammarSpec("regex", "q")).matcher()
    xy = compiler.compile("t", GrammarSpec("regex", "[xy]z")).matcher()
    logits = torch.zeros(3, 257)
    apply_grammar_masks(logits, [(2, q), (0, xy)])
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [[ord("x"), ord("y")], list(range(257)), [ord("q")]]
