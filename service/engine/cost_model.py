"""What a step costs, so the budget can size it to a time target.

A step is its decode rows plus its prefill chunks, and the two cost differently:

- the decode-only part, ``base_s + per_row_s * rows + per_row_key_s * keys`` (plus
  ``dense_s`` once rows leave the packed weights), is fitted on decode-only steps. On CPU
  one row costs about as much as several (the weights are read once either way), so it
  cannot be extrapolated from prefill steps;
- each prefill chunk adds ``per_chunk_s + per_token_s * tokens + per_key_s * keys``, fitted
  on what steps with chunks took beyond their decode-only part, plus ``chunk_dense_s`` when
  the chunk takes the step past the packed weights. The key term matters: on CPU a 16-token
  chunk at position 1,500 costs several times what it costs at position 0.

The hardware regime is data the model and backend report (``Regime``), never a rule in the
scheduler: on CPU, batches of up to ``packed_rows`` tokens run on packed 4-bit weights and
larger ones on dense weights, so a step's cost jumps there (measured on a 2-core Xeon, 15
decode rows: a 32-token chunk added 10 ms, a 128-token one 50-72 ms); on GPU, decode
batches replay CUDA graphs captured at ``graph_sizes`` and cost what the padded size costs.
The fit learns the jumps as their own terms, and ``chunk_tokens`` picks the larger chunk of
the two regimes that fits the time, so a tight bound keeps a step on the packed weights and
a loose one takes it dense.

Both fits are exponentially weighted least squares, so they follow a machine whose load
changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.engine.least_squares import LeastSquares


def chunk_keys(context: int, tokens: int) -> int:
    """Keys read by ``tokens`` new tokens after ``context`` computed ones (causal)."""
    return tokens * context + tokens * (tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class Regime:
    """What the model and backend report about their step costs.

    ``packed_rows``: batches of up to this many tokens run on packed weights at one cost,
    larger ones on dense weights at another (0: one set of weights). ``graph_sizes``: decode
    batches run padded to the smallest of these sizes that holds them (CUDA graphs; empty:
    eager, unpadded)."""

    packed_rows: int = 0
    graph_sizes: tuple[int, ...] = ()

    def dense(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs on the dense weights."""
        return 0 < self.packed_rows < tokens

    def padded(self, rows: int) -> int:
        """The batch a decode step of ``rows`` rows runs as."""
        return next((s for s in sorted(self.graph_sizes) if s >= rows), rows)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's cost depends on: its decode rows and the keys they read, and its
    prefill chunks as ``(context, tokens)``."""

    rows: int
    row_keys: int
    chunks: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class StepCost:
    """A fitted step cost: the decode-only part and what each prefill chunk adds."""

    base_s: float
    per_row_s: float
    per_row_key_s: float
    per_chunk_s: float
    per_token_s: float
    per_key_s: float
    dense_s: float = 0.0  # what a decode-only step past the packed weights adds
    chunk_dense_s: float = 0.0  # what a chunk taking the step past the packed weights adds
    regime: Regime = Regime()
    # Decode-only steps as observed, by the batch size they ran as: (rows, seconds, keys),
    # averaged. Where a batch size was seen, its own time beats the line (below).
    observed: tuple[tuple[int, float, float], ...] = ()

    def decode_seconds(self, rows: int, keys: int) -> float:
        """Predicted wall time of a step of ``rows`` decode rows reading ``keys`` keys: that
        batch size's own observed time where there is one, else the fitted line.
        NOTE: a step's cost is not linear in its rows (on CPU one row runs a memory-bound
        loop, a few rows share a tile, many run dense), and the line fits the batch sizes of
        recent steps. Under a tenant's sixteen streams it priced a victim's lone row at 28 ms
        against the 16 ms it costs, and the guard let the victim's step run to 2x that."""
        padded = self.regime.padded(rows)
        for seen, seconds, seen_keys in self.observed:
            if seen == padded:
                return max(0.0, seconds + self.per_row_key_s * (keys - seen_keys))
        line = (self.base_s, self.per_row_s, self.per_row_key_s, self.dense_s)
        return _decode_seconds(line, self.regime, rows, keys)

    def chunk_seconds(self, context: int, tokens: int, step_tokens: int = 0) -> float:
        """What a chunk of ``tokens`` after ``context`` computed tokens adds to a step that
        already carries ``step_tokens`` tokens."""
        keys = chunk_keys(context, tokens)
        line = self.per_chunk_s + self.per_token_s * tokens + self.per_key_s * keys
        return line + self._jump(step_tokens, tokens)

    def chunk_tokens(self, seconds: float, context: int, step_tokens: int = 0) -> int:
        """The most tokens one chunk after ``context`` computed tokens adds within
        ``seconds`` to a step that already carries ``step_tokens`` tokens: the larger of the
        chunk that keeps the step on its weights and the one that pays the jump past them."""
        packed = self.regime.packed_rows
        if packed <= 0 or self.regime.dense(step_tokens):
            return self._line_tokens(seconds, context)
        stay = min(self._line_tokens(seconds, context), packed - step_tokens)
        leave = self._line_tokens(seconds - self.chunk_dense_s, context)
        return leave if leave > packed - step_tokens else stay

    def _jump(self, step_tokens: int, tokens: int) -> float:
        crosses = not self.regime.dense(step_tokens) and self.regime.dense(step_tokens + tokens)
        return self.chunk_dense_s if crosses else 0.0

    def _line_tokens(self, seconds: float, context: int) -> int:
        seconds -= self.per_chunk_s
        if seconds <= 0:
            return 0
        # per_key/2 t^2 + (per_token + per_key (context + 1/2)) t <= seconds, solved as
        # 2 s / (b + sqrt(b^2 + 4 a s)): the textbook (-b + sqrt(...)) / 2a cancels to
        # nonsense when a fitted per_key_s is tiny (1e-23 gave 0 tokens, or thousands).
        a = self.per_key_s / 2
        b = self.per_token_s + self.per_key_s * (context + 0.5)
        root = b + math.sqrt(b * b + 4 * a * seconds)
        tokens = 2 * seconds / root if root > 0 else float(1 << 30)
        return int(min(tokens, 1 << 30) + 1e-6)  # a fit's rounding must not lose a whole token


def _decode_seconds(line: Sequence[float], regime: Regime, rows: int, keys: int) -> float:
    """A decode step's time from the fit's ``(base, per row, per key, dense jump)``."""
    base, per_row, per_key, dense = line
    jump = dense if regime.dense(rows) else 0.0
    return base + per_row * regime.padded(rows) + per_key * keys + jump


# Feature subsets the fits try, most complete first. Decode: (1, rows, keys, dense);
# chunks: (n, tokens, keys, crossed).
_DECODE_TRIES = ((0, 1, 2, 3), (0, 1, 3), (0, 3), (0, 1, 2), (0, 1), (0,))
_CHUNK_TRIES = ((0, 1, 2, 3), (1, 2, 3), (0, 1, 3), (1, 3), (0, 1, 2), (1, 2), (0, 1), (1,))


@dataclass(slots=True)
class StepCostModel:
    """Fits ``StepCost`` from observed steps on the hardware ``regime``.
    NOTE: before a step past the packed weights is seen, the jump is unknown (0) and the fit
    is the packed line alone; the first such step teaches it."""

    regime: Regime = Regime()
    decay: float = 0.9  # SchedulerTuning.cost_decay
    observed_rows: int = 16  # SchedulerTuning.observed_rows
    decode: LeastSquares = field(init=False)  # 1, rows, keys, dense
    chunks: LeastSquares = field(init=False)  # n, tokens, keys, crossed

    # EW averages of decode-only steps' (seconds, keys) by padded batch size, for batches
    # up to ``observed_rows`` rows.
    by_rows: dict[int, tuple[float, float]] = field(init=False)
    # The fit of the steps observed so far (``fit`` solves it once between observations:
    # a step asks for it more than once, when it is planned and when its rows are charged).
    _fitted: tuple[StepCost | None] | None = field(init=False)

    def __post_init__(self) -> None:
        self.decode = LeastSquares(4, self.decay)
        self.chunks = LeastSquares(4, self.decay)
        self.by_rows = {}
        self._fitted = None

    def observe(
        self, rows: int, row_keys: int, chunks: Sequence[tuple[int, int]], seconds: float
    ) -> None:
        """A step of ``rows`` decode rows reading ``row_keys`` keys and prefill ``chunks``
        (each ``(context, tokens)``) took ``seconds``."""
        if seconds <= 0 or (rows <= 0 and not chunks):
            return
        self._fitted = None
        regime = self.regime
        if not chunks:
            dense = 1.0 if regime.dense(rows) else 0.0
            self.decode.observe((1.0, regime.padded(rows), row_keys, dense), seconds)
            padded = regime.padded(rows)
            if padded <= self.observed_rows:
                last = self.by_rows.get(padded)
                # The same decay as the fit: it follows the machine's load just as fast.
                d = self.decay if last is not None else 0.0
                was = last or (0.0, 0.0)
                self.by_rows[padded] = (
                    d * was[0] + (1.0 - d) * seconds, d * was[1] + (1.0 - d) * row_keys
                )
            return
        rest = seconds - self._decode_part(rows, row_keys)
        tokens = sum(t for _, t in chunks)
        keys = sum(chunk_keys(c, t) for c, t in chunks)
        crossed = 1.0 if not regime.dense(rows) and regime.dense(rows + tokens) else 0.0
        self.chunks.observe((len(chunks), tokens, keys, crossed), rest)

    def _decode_part(self, rows: int, keys: int) -> float:
        """The decode rows' share of a step with chunks, at their own batch size: where a
        chunk takes the step onto the dense weights, the chunk fit's jump term absorbs it."""
        if not self.decode.measured:
            return 0.0
        return _decode_seconds(self.decode.fit(_DECODE_TRIES, 0), self.regime, rows, keys)

    def fit(self) -> StepCost | None:
        """The fitted cost, or None before a step with prefill chunks was observed."""
        if self._fitted is None:
            self._fitted = (self._solve(),)
        return self._fitted[0]

    def _solve(self) -> StepCost | None:
        if not self.chunks.measured:
            return None
        base, per_row, per_row_key, dense = self.decode.fit(_DECODE_TRIES, 0)
        per_chunk, per_token, per_key, crossed = self.chunks.fit(_CHUNK_TRIES, 1)
        return StepCost(
            base, per_row, per_row_key, per_chunk, per_token, per_key, dense, crossed,
            self.regime, tuple((r, s, k) for r, (s, k) in sorted(self.by_rows.items())),
        )
