"""Batched sampling on the device.

Everything below is tensor ops over the whole ``[B, vocab]`` logits; the only Python loops
run over the rows of the batch (never over the vocabulary), and the only host sync is the
single ``.tolist()`` that brings the chosen ids (and logprobs, packed into the same
tensor) back. Order of processing, per row:

1. ban stop tokens while fewer than ``min_tokens`` were generated; add the row's logit
   bias (a banned or grammar-refused token stays refused whatever its bias); rows with a
   grammar keep only the tokens it allows (``grammar.py``);
2. repetition penalty (prompt + output tokens), presence and frequency penalties (output);
3. greedy rows take the argmax here;
4. temperature, then top-k, top-p, min-p truncation;
5. sampling by exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn per row from
   the row's own ``torch.Generator`` when it has a seed, so a seeded request draws the same
   noise whatever else is in the batch.

Logprobs are ``log_softmax`` of the logits after steps 1–2 and temperature scaling
(temperature 1 for greedy rows), before top-k/top-p/min-p truncation: the model's
distribution as the request shaped it, with every alternative still finite.

Each row's cost beyond a plain argmax (its grammar mask, its share of the stages it opted
into) is measured and returned (``SampleResult.row_s``): the scheduler charges it to the
row's tenant and counts it in the step's cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from service.engine.types import SamplingParams, TokenLogprob
from service.structured.grammar import GrammarMatcher, apply_grammar_masks


@dataclass(frozen=True, slots=True)
class SampleRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    generator: torch.Generator | None  # set when the request has a seed
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    banned_ids: tuple[int, ...] = ()  # stop tokens masked out (min_tokens not reached yet)
    num_logprobs: int = 0
    grammar: GrammarMatcher | None = None  # structured output: only its allowed tokens


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # Seconds of this step's sampling owed to each row beyond a plain argmax: its grammar
    # mask, and its share of each stage only some rows need (penalties, truncation, the
    # draw, logprobs), split among the rows that asked for it. Empty: not measured.
    row_s: list[float] = field(default_factory=list)


class _RowCosts:
    """Per-row seconds of the stages rows opt into (``SampleResult.row_s``)."""

    def __init__(self, n: int) -> None:
        self.seconds = [0.0] * n
        self._began = time.perf_counter()

    def lap(self, rows: Sequence[int]) -> None:
        """The time since the last lap was spent for ``rows`` (split evenly)."""
        now = time.perf_counter()
        if rows:
            share = (now - self._began) / len(rows)
            for i in rows:
                self.seconds[i] += share
        self._began = now


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    """Samples one token per row. Holds the generator used by rows without a seed."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
        """``logits``: ``[len(rows), vocab]`` float32 on the sampler's device."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sample rows")
        logits = logits.float()
        self._ban(logits, rows)
        self._bias(logits, rows)
        costs = _RowCosts(len(rows))
        constrained = [i for i, r in enumerate(rows) if r.grammar]
        masks = apply_grammar_masks(
            logits, [(i, r.grammar) for i, r in enumerate(rows) if r.grammar]
        )
        for i, mask_s in zip(constrained, masks, strict=True):
            costs.seconds[i] += mask_s
        costs.lap([])  # the masks' unpacking: shared by the step
        penalized = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if penalized:
            logits = self._penalize(logits, rows)
            costs.lap(penalized)
        greedy = [r.params.temperature == 0.0 for r in rows]
        max_n = max(r.num_logprobs for r in rows)
        if all(greedy) and max_n == 0:
            return SampleResult(_argmax(logits), [None] * len(rows), costs.seconds)

        temps = torch.tensor(
            [1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)],
            device=self.device,
        )
        scaled = logits / temps[:, None]
        chosen = logits.argmax(dim=-1)
        costs.lap([])
        if not all(greedy):
            sampled = self._draw(self._truncate(scaled, rows), rows)
            greedy_mask = torch.tensor(greedy, device=self.device)
            chosen = torch.where(greedy_mask, chosen, sampled)
            costs.lap([i for i, g in enumerate(greedy) if not g])
        if max_n == 0:
            return SampleResult(chosen.tolist(), [None] * len(rows), costs.seconds)
        result = self._with_logprobs(scaled, chosen, rows, max_n)
        costs.lap([i for i, r in enumerate(rows) if r.num_logprobs])
        return SampleResult(result.token_ids, result.logprobs, costs.seconds)

    def _ban(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        pairs = [(i, t) for i, r in enumerate(rows) for t in r.banned_ids]
        if pairs:
            idx = torch.tensor(pairs, dtype=torch.long, device=self.device)
            logits[idx[:, 0], idx[:, 1]] = float("-inf")

    def _bias(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        triples = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
        if triples:
            idx = torch.tensor([(i, t) for i, t, _ in triples], dtype=torch.long, device=self.device)
            bias = torch.tensor([b for _, _, b in triples], device=self.device)
            logits.index_put_((idx[:, 0], idx[:, 1]), bias, accumulate=True)

    def _penalize(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        # NOTE: only the rows that ask for a penalty are touched, and each costs its own
        # tokens (plus its vocab-sized row): one penalized row never makes the sampler pad
        # every row to the batch's longest prompt.
        picked = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        own = [rows[i] for i in picked]
        index = torch.tensor(picked, dtype=torch.long, device=self.device)
        sub = logits.index_select(0, index)
        counts = torch.zeros_like(sub)
        out_rows, out_ids = self._flat([r.output_ids for r in own])
        counts.index_put_(
            (out_rows, out_ids), torch.ones_like(sub[0, :1]).expand_as(out_ids), accumulate=True
        )
        params = torch.tensor(
            [
                [r.params.repetition_penalty, r.params.presence_penalty, r.params.frequency_penalty]
                for r in own
            ],
            device=self.device,
        )
        rep, pres, freq = params[:, 0:1], params[:, 1:2], params[:, 2:3]
        if any(r.params.repetition_penalty != 1.0 for r in own):
            seen = counts > 0
            prompt_rows, prompt_ids = self._flat(
                [r.prompt_ids if r.params.repetition_penalty != 1.0 else () for r in own]
            )
            seen[prompt_rows, prompt_ids] = True
            penalized = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalized, sub)
        sub = sub - pres * (counts > 0) - freq * counts
        return logits.index_copy_(0, index, sub)

    def _flat(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token id) pairs of ragged rows, without padding."""
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=self.device)
        rows = torch.repeat_interleave(torch.arange(len(seqs), device=self.device), lengths)
        ids = [torch.as_tensor(s, dtype=torch.long) for s in seqs if len(s)]
        flat = torch.cat(ids).to(self.device) if ids else rows.new_empty(0)
        return rows, flat

    def _truncate(self, scaled: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        vocab = scaled.shape[1]
        picked = [
            i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0
        ]
        if picked:
            index = torch.tensor(picked, dtype=torch.long, device=self.device)
            sub = scaled.index_select(0, index)
            sub = _top_k_top_p(sub, [rows[i].params for i in picked], vocab)
            scaled = scaled.index_copy(0, index, sub)
        if any(r.params.min_p > 0.0 for r in rows):
            min_ps = torch.tensor([r.params.min_p for r in rows], device=self.device)
            probs = scaled.softmax(dim=-1)
            floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
        return scaled

    def _draw(self, scaled: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        # Inverse CDF: one uniform per row, the first token whose cumulative probability
        # passes it. NOTE: the exponential race (argmax p / q, q ~ Exp(1)) drew a random
        # number per vocabulary entry: 17 ms of a 37 ms sampler-heavy step of 16 rows.
        probs = scaled.softmax(dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = torch.empty(len(rows), device=self.device)
        u.uniform_(generator=self._generator)
        for i, r in enumerate(rows):
            if r.generator is not None and r.params.temperature != 0.0:
                u[i : i + 1].uniform_(generator=r.generator)
        # Scaled by the row's total (a float cumsum may end a little off 1.0); the first
        # entry strictly past it has a non-zero probability.
        total = cdf[:, -1:]
        target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, cdf.new_zeros(())))
        picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
        return picked.clamp_(max=scaled.shape[1] - 1)

    def _with_logprobs(
        self,
        scaled: torch.Tensor,
        chosen: torch.Tensor,
        rows: Sequence[SampleRow],
        max_n: int,
    ) -> SampleResult:
        logprobs = scaled.log_softmax(dim=-1)
        chosen_lp = logprobs.gather(1, chosen[:, None])
        top_lp, top_ids = logprobs.topk(max_n, dim=-1)
        # One transfer for everything: ids are exact in float64.
        packed = torch.cat(
            [chosen[:, None].double(), chosen_lp.double(), top_ids.double(), top_lp.double()],
            dim=1,
        ).tolist()
        ids: list[int] = []
        out: list[TokenLogprob | None] = []
        for r, row in zip(rows, packed, strict=True):
            token = int(row[0])
            ids.append(token)
            if r.num_logprobs == 0:
                out.append(None)
                continue
            n = r.num_logprobs
            top = tuple((int(row[2 + j]), float(row[2 + max_n + j])) for j in range(n))
            out.append(TokenLogprob(token, float(row[1]), top))
        return SampleResult(ids, out)


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first maximum; a NaN row's first NaN), as torch's.
    NOTE: measured on a 2-core AVX2 EPYC: torch's CPU argmax over 49,152 logits took ~127 us
    a row, numpy's (SIMD) ~6."""
    if logits.device.type != "cpu":
        out: list[int] = logits.argmax(dim=-1).tolist()
        return out
    return [int(i) for i in np.argmax(logits.numpy(), axis=-1)]


# NOTE: a full sort of the vocabulary (49k) was most of a sampler-heavy step: 30 ms of the
# 68 ms that 16 top-p rows with logprobs and penalties took on 2 cores, paid by every row
# of the step. The nucleus of a real model's distribution lies in its first few hundred
# tokens, so the rows are cut on their top CANDIDATES first, and only a row whose cut is
# not decided there (a flat distribution, top-k beyond it) sorts its whole vocabulary.
CANDIDATES = 256


def _top_k_top_p(
    scaled: torch.Tensor, params: Sequence[SamplingParams], vocab: int
) -> torch.Tensor:
    """``scaled`` with each row's tokens outside its top-k and its nucleus (top-p) set to
    -inf. Exactly the tokens a full descending sort would keep: a token is removed when its
    rank is at least top-k, or when the probability mass strictly ahead of it (among the
    top-k tokens) exceeds top-p; the most likely token is always kept."""
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # Rows without top-p keep every token (inf, not 1.0: a cumsum may round past 1.0).
    ps = torch.tensor(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=scaled.device
    )
    width = min(vocab, max([CANDIDATES, *(k for k in ks if k < vocab)]))
    decided, remove, order = _cut(scaled, ks, ps, width)
    if not bool(decided.all()):
        rest = (~decided).nonzero().flatten()
        sub = scaled.index_select(0, rest)
        _, full_remove, full_order = _cut(
            sub, [ks[int(i)] for i in rest], ps.index_select(0, rest), vocab
        )
        mask = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, full_order, full_remove)
        scaled = scaled.index_copy(0, rest, sub.masked_fill(mask, float("-inf")))
    keep = decided.nonzero().flatten()
    if keep.numel():
        sub = scaled.index_select(0, keep)
        # Every token past the candidates is removed for a decided row.
        mask = torch.ones_like(sub, dtype=torch.bool)
        mask.scatter_(1, order.index_select(0, keep), remove.index_select(0, keep))
        scaled = scaled.index_copy(0, keep, sub.masked_fill(mask, float("-inf")))
    return scaled


def _cut(
    scaled: torch.Tensor, ks: Sequence[int], ps: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top ``width`` tokens of each row (descending), which of them are removed, and
    whether the row's cut is decided within them (every token past them is removed too)."""
    top, order = scaled.topk(width, dim=-1, largest=True, sorted=True)
    ranks = torch.arange(width, device=scaled.device)[None, :]
    k = torch.tensor(ks, device=scaled.device)[:, None]
    remove = ranks >= k
    # The mass ahead of each candidate is over the row's top-k tokens: those among the
    # candidates when top-k fits in them, else the whole row (its log-sum-exp).
    within = k <= width
    kept = top.masked_fill(remove, float("-inf"))
    norm = torch.where(
        within.squeeze(1), kept.logsumexp(dim=-1), scaled.logsumexp(dim=-1)
    )[:, None]
    probs = (kept - norm).exp()
    before = probs.cumsum(dim=-1) - probs
    remove |= before > ps[:, None]
    remove[:, 0] = False
    decided = within.squeeze(1) | remove[:, -1] | (width == scaled.shape[1])
    return decided, remove, order

