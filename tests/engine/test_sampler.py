"""Batched sampler: each option against a direct reference computation."""

from __future__ import annotations

import math
from typing import NoReturn

import pytest
import torch

from service.engine.sampler import Sampler, SampleRow
from service.engine.types import SamplingParams

V = 8


def row(
    params: SamplingParams,
    seed: int | None = None,
    prompt: tuple[int, ...] = (0,),
    output: tuple[int, ...] = (),
    banned: tuple[int, ...] = (),
    logprobs: int = 0,
) -> SampleRow:
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return SampleRow(params, gen, prompt, output, banned, logprobs)


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


BASE = [0.5, 2.0, -1.0, 1.5, 0.0, 3.0, -2.0, 1.0]  # argmax 5, then 1, 3, 7


def test_greedy_is_argmax_and_banned_tokens_are_never_chosen() -> None:
    s = Sampler(seed=0)
    greedy = SamplingParams(temperature=0.0)
    out = s.sample(logits_of(BASE, BASE), [row(greedy), row(greedy, banned=(5,))])
    assert out.token_ids == [5, 1]
    assert out.logprobs == [None, None]


def test_greedy_picks_the_first_maximum_as_torch_argmax_does() -> None:
    """The greedy rows' argmax (numpy's on CPU) is torch's: the first of tied maxima, a
    row's first NaN, and on random batches the same index."""
    s = Sampler(seed=0)
    greedy = SamplingParams(temperature=0.0)
    tied = [0.0, 2.0, 1.0, 2.0, -1.0, 2.0, 0.0, 0.0]
    nan = [0.0, 5.0, math.nan, 9.0, math.nan, 0.0, 0.0, 0.0]
    out = s.sample(logits_of(tied, nan, [-math.inf] * 7 + [-1.0]), [row(greedy)] * 3)
    assert out.token_ids == [1, 2, 7]
    gen = torch.Generator().manual_seed(4)
    for n in (1, 5):
        logits = torch.randn(n, 49152, generator=gen)
        want = logits.argmax(dim=-1).tolist()
        assert s.sample(logits, [row(greedy)] * n).token_ids == want


def test_penalties_match_reference() -> None:
    logits = torch.tensor(BASE)
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    prompt, output = (1, 2), (5, 5, 3)
    expected = logits.clone()
    for t in {1, 2, 5, 3}:  # repetition: prompt and output tokens
        expected[t] = expected[t] / 2.0 if expected[t] > 0 else expected[t] * 2.0
    for t, n in {5: 2, 3: 1}.items():  # presence and frequency: output tokens only
        expected[t] -= 0.5 + 0.25 * n
    s = Sampler(seed=0)
    out = s.sample(logits[None].clone(), [row(params, prompt=prompt, output=output, logprobs=3)])
    assert out.token_ids == [int(expected.argmax())]
    lp = out.logprobs[0]
    assert lp is not None
    ref = expected.log_softmax(-1)
    assert lp.logprob == pytest.approx(float(ref.max()), abs=1e-5)
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_logprobs_are_of_the_temperature_scaled_untruncated_distribution() -> None:
    params = SamplingParams(temperature=0.5, top_k=2, seed=1)
    s = Sampler(seed=0)
    out = s.sample(logits_of(BASE), [row(params, seed=1, logprobs=4)])
    lp = out.logprobs[0]
    assert lp is not None
    ref = (torch.tensor(BASE) / 0.5).log_softmax(-1)
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-5)
    assert len(lp.top) == 4
    for token, value in lp.top:
        assert value == pytest.approx(float(ref[token]), abs=1e-5)
    assert [t for t, _ in lp.top] == [5, 1, 3, 7]


def empirical(params: SamplingParams, logits: list[float], n: int = 6000) -> torch.Tensor:
    s = Sampler(seed=123)
    out = s.sample(logits_of(*([logits] * n)), [row(params)] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=V).float() / n


def assert_close_to(freq: torch.Tensor, probs: torch.Tensor) -> None:
    for f, p in zip(freq.tolist(), probs.tolist(), strict=True):
        assert abs(f - p) <= 4 * math.sqrt(max(p * (1 - p), 1e-9) / 6000) + 1e-9, (freq, probs)


def test_temperature_sampling_follows_softmax() -> None:
    probs = (torch.tensor(BASE) / 0.7).softmax(-1)
    assert_close_to(empirical(SamplingParams(temperature=0.7), BASE), probs)


def test_top_k_top_p_min_p_truncate_then_renormalise() -> None:
    base = torch.tensor(BASE)
    p = base.softmax(-1)

    def renorm(keep: list[int]) -> torch.Tensor:
        out = torch.zeros(V)
        out[keep] = p[keep] / p[keep].sum()
        return out

    assert_close_to(empirical(SamplingParams(top_k=3), BASE), renorm([5, 1, 3]))
    # top_p: sorted probs 5, 1, 3, ...; keep until the mass ahead of a token exceeds top_p.
    ahead = float(p[5] + p[1])
    assert_close_to(empirical(SamplingParams(top_p=ahead + 1e-3), BASE), renorm([5, 1, 3]))
    assert_close_to(empirical(SamplingParams(top_p=ahead - 1e-3), BASE), renorm([5, 1]))
    floor = float(p[5]) * 0.3
    keep = [i for i in range(V) if float(p[i]) >= floor]
    assert_close_to(empirical(SamplingParams(min_p=0.3), BASE), renorm(keep))


def test_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    torch.manual_seed(0)
    steps = [torch.randn(V) for _ in range(6)]
    params = SamplingParams(temperature=1.0, seed=42)

    def run(batch_size: int, position: int, sampler_seed: int) -> list[int]:
        s = Sampler(seed=sampler_seed)
        target = row(params, seed=42)
        others = [row(SamplingParams(temperature=1.3)) for _ in range(batch_size - 1)]
        tokens = []
        for logits in steps:
            rows = [*others[:position], target, *others[position:]]
            batch = torch.randn(batch_size, V)
            batch[position] = logits
            tokens.append(s.sample(batch, rows).token_ids[position])
        return tokens

    alone = run(1, 0, 0)
    assert run(5, 3, 1) == alone
    assert run(9, 0, 2) == alone
    different_seed = Sampler(seed=0)
    other = row(SamplingParams(temperature=1.0, seed=43), seed=43)
    assert [different_seed.sample(x[None], [other]).token_ids[0] for x in steps] != alone


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    s = Sampler(seed=0)
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=5.0))] * 50
    out = s.sample(logits_of(*([BASE] * 100)), rows)
    assert out.token_ids[0::2] == [5] * 50
    assert len(set(out.token_ids[1::2])) > 1


def _reference(
    logits: torch.Tensor, p: SamplingParams, prompt: tuple[int, ...], out: tuple[int, ...]
) -> torch.Tensor:
    expected = logits.clone()
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(out):
            r = p.repetition_penalty
            expected[t] = expected[t] / r if expected[t] > 0 else expected[t] * r
    for t in set(out):
        expected[t] -= p.presence_penalty + p.frequency_penalty * out.count(t)
    return expected


def test_penalties_in_a_mixed_ragged_batch_match_reference() -> None:
    cases = [
        (SamplingParams(temperature=0.0), (1, 2, 3, 4, 5, 6, 7), (5,)),
        (SamplingParams(temperature=0.0, repetition_penalty=1.7), (5,), ()),
        (SamplingParams(temperature=0.0, presence_penalty=1.0), (1, 2, 3, 4, 6), (3, 3, 7)),
        (
            SamplingParams(temperature=0.0, frequency_penalty=-0.5, repetition_penalty=0.5),
            (0,),
            (2, 2, 6),
        ),
    ]
    logits = torch.tensor([BASE, BASE[::-1], BASE, BASE[::-1]])
    rows = [row(p, prompt=pr, output=o, logprobs=V) for p, pr, o in cases]
    out = Sampler(seed=0).sample(logits.clone(), rows)
    for i, (p, pr, o) in enumerate(cases):
        ref = _reference(logits[i], p, pr, o).log_softmax(-1)
        lp = out.logprobs[i]
        assert lp is not None
        got = dict(lp.top)
        assert [got[t] for t in range(V)] == pytest.approx(ref.tolist(), abs=1e-5), i


class _Untouchable(tuple[int, ...]):
    """Token ids that fail the test if the sampler reads them."""

    def __iter__(self) -> NoReturn:
        raise AssertionError("read another row's tokens")

    def __len__(self) -> int:
        raise AssertionError("read another row's tokens")

    def __getitem__(self, i: object) -> NoReturn:
        raise AssertionError("read another row's tokens")


def test_penalty_cost_is_the_penalized_rows_own_tokens() -> None:
    """One penalized row must not make the sampler read (and pad to) every other
    row's prompt; it used to build a batch x longest-prompt tensor each step."""
    huge = _Untouchable(range(8000))
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    rows = [row(plain, prompt=huge, output=huge) for _ in range(3)]
    rows.append(row(penalized, prompt=(5,), output=()))
    out = Sampler(seed=0).sample(logits_of(BASE, BASE, BASE, BASE), rows)
    assert out.token_ids == [5, 5, 5, 1]  # 3.0 / 2 = 1.5 < 2.0: token 1 wins the last row


def _sorted_cut(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Reference: which tokens a full descending sort keeps under top-k then top-p."""
    vocab = scaled.shape[1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    for i, p in enumerate(params):
        values, order = scaled[i].sort(descending=True)
        k = p.top_k if 0 < p.top_k < vocab else vocab
        probs = values[:k].softmax(dim=-1)
        ahead = probs.cumsum(dim=-1) - probs
        kept = ahead <= p.top_p if p.top_p < 1.0 else torch.ones(k, dtype=torch.bool)
        kept[0] = True
        row = torch.zeros(vocab, dtype=torch.bool)
        row[order[:k][kept]] = True
        keep[i] = row
    return keep


@pytest.mark.parametrize("peaked", [True, False])
def test_top_k_top_p_keeps_what_a_full_sort_keeps(peaked: bool) -> None:
    """The candidate cut equals the full-sort cut, for rows decided among the candidates
    (peaked) and rows that need the whole vocabulary (flat, large top-k)."""
    from service.engine.sampler import CANDIDATES, _top_k_top_p

    gen = torch.Generator().manual_seed(7)
    vocab = 4 * CANDIDATES + 3
    scaled = torch.randn(24, vocab, generator=gen) * (1.0 if peaked else 0.05)
    if peaked:
        scaled[:, :20] += 9.0
    params = [
        SamplingParams(temperature=1.0, top_p=tp, top_k=tk)
        for tp in (0.3, 0.9, 0.999, 1.0)
        for tk in (0, 5, CANDIDATES + 40, vocab + 1, 2 * CANDIDATES, 1)
    ]
    got = _top_k_top_p(scaled.clone(), params, vocab) > float("-inf")
    assert torch.equal(got, _sorted_cut(scaled, params))
