"""What a step costs, so the scheduler can size it to a time target.

A step is its decode rows plus its prefill chunks, and the two cost differently:

- the decode-only part, ``base_s + per_row_s * rows + per_row_key_s * keys`` (plus
  ``dense_s`` once rows exceed ``packed_rows``), is fitted on decode-only steps. On CPU one
  row costs about as much as several (the weights are read once either way), so it cannot
  be extrapolated from prefill steps. Where the model serves batches of up to
  ``packed_rows`` tokens from packed 4-bit weights and larger ones from dense weights, the
  step's cost jumps at that size (on a 2-core AVX2 CPU in float32, 4 rows took ~26 ms and
  the dense step above ~100 ms), which no line through both regimes predicts;
- each prefill chunk adds ``per_chunk_s + per_token_s * tokens + per_key_s * keys``, fitted
  on what steps with chunks took beyond their decode-only part. The key term matters: on
  CPU a 16-token chunk at position 1,500 costs several times what it costs at position 0,
  so a per-token model alone lets late chunks of a long prompt overrun the target.

Both fits are exponentially weighted least squares, so they follow a machine whose load
changes. The scheduler sizes steps from them in the spirit of Sarathi-Serve's stall-free
batching: decodes always run, and prefill chunks take what is left of the step's time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

_DECAY = 0.9  # weight of the past per observed step


def chunk_keys(context: int, tokens: int) -> int:
    """Keys read by ``tokens`` new tokens after ``context`` computed ones (causal)."""
    return tokens * context + tokens * (tokens + 1) // 2


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
    dense_s: float = 0.0  # what a decode step above ``packed_rows`` rows adds (dense weights)
    packed_rows: int = 0  # the largest batch the packed weights serve; 0: no packed regime

    def decode_seconds(self, rows: int, keys: int) -> float:
        """Predicted wall time of a step of ``rows`` decode rows reading ``keys`` keys."""
        line = (self.base_s, self.per_row_s, self.per_row_key_s, self.dense_s)
        return _decode_seconds(line, self.packed_rows, rows, keys)

    def chunk_seconds(self, context: int, tokens: int) -> float:
        """What a chunk of ``tokens`` after ``context`` computed tokens adds to a step."""
        keys = chunk_keys(context, tokens)
        return self.per_chunk_s + self.per_token_s * tokens + self.per_key_s * keys

    def chunk_tokens(self, seconds: float, context: int) -> int:
        """The most tokens one chunk after ``context`` computed tokens adds within ``seconds``."""
        seconds -= self.per_chunk_s
        if seconds <= 0:
            return 0
        # per_key/2 t^2 + (per_token + per_key (context + 1/2)) t <= seconds
        a = self.per_key_s / 2
        b = self.per_token_s + self.per_key_s * (context + 0.5)
        if a <= 0:
            tokens = seconds / b if b > 0 else float(1 << 30)
        else:
            tokens = (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)
        return int(tokens + 1e-6)  # a fit's rounding must not lose a whole token


@dataclass(slots=True)
class LeastSquares:
    """Exponentially weighted least squares of ``y`` on a few non-negative coefficients."""

    size: int
    _xx: list[list[float]] = field(init=False)  # decayed sum of x x^T
    _xy: list[float] = field(init=False)  # decayed sum of x y

    def __post_init__(self) -> None:
        self._xx = [[0.0] * self.size for _ in range(self.size)]
        self._xy = [0.0] * self.size

    @property
    def measured(self) -> bool:
        return any(self._xx[i][i] > 0 for i in range(self.size))

    def observe(self, x: Sequence[float], y: float) -> None:
        for i in range(self.size):
            self._xy[i] = _DECAY * self._xy[i] + x[i] * y
            for j in range(self.size):
                self._xx[i][j] = _DECAY * self._xx[i][j] + x[i] * x[j]

    def fit(self, tries: Sequence[tuple[int, ...]], mean_of: int) -> list[float]:
        """Coefficients of the first feature subset in ``tries`` whose fit is non-negative
        (steps too alike to tell terms apart drop the later ones); else all of ``y`` charged
        to feature ``mean_of``."""
        for used in tries:
            xx = [[self._xx[i][j] for j in used] for i in used]
            coef = _solve(xx, [self._xy[i] for i in used])
            if coef is not None and all(c >= 0 for c in coef):
                full = [0.0] * self.size
                for i, c in zip(used, coef, strict=True):
                    full[i] = c
                return full
        full = [0.0] * self.size
        if self._xx[mean_of][mean_of] > 0:
            # sum(x y) / sum(x x) over one feature: least squares through the origin
            full[mean_of] = max(0.0, self._xy[mean_of] / self._xx[mean_of][mean_of])
        return full


def _dense(rows: int, packed_rows: int) -> bool:
    """Whether a batch of ``rows`` tokens runs on the dense weights past the packed ones."""
    return packed_rows > 0 and rows > packed_rows


def _decode_seconds(line: Sequence[float], packed_rows: int, rows: int, keys: int) -> float:
    """A decode step's time from the fit's ``(base, per row, per key, dense jump)``."""
    base, per_row, per_key, dense = line
    jump = dense if _dense(rows, packed_rows) else 0.0
    return base + per_row * rows + per_key * keys + jump


# Feature subsets the decode fit tries, most complete first: (1, rows, keys, dense).
_DECODE_TRIES = ((0, 1, 2, 3), (0, 1, 3), (0, 3), (0, 1, 2), (0, 1), (0,))


@dataclass(slots=True)
class StepCostModel:
    """Fits ``StepCost`` from observed steps. ``packed_rows`` is the model's
    ``max_packed_rows`` (0 where every batch runs on the same weights).
    NOTE: before any decode step above ``packed_rows`` rows is seen, the dense term is
    unknown and the fit is the packed line alone; the first such step teaches it."""

    packed_rows: int = 0
    # 1, rows, keys, dense (rows > packed_rows)
    decode: LeastSquares = field(default_factory=lambda: LeastSquares(4))
    chunks: LeastSquares = field(default_factory=lambda: LeastSquares(3))  # n, tokens, keys

    def observe(
        self, rows: int, row_keys: int, chunks: Sequence[tuple[int, int]], seconds: float
    ) -> None:
        """A step of ``rows`` decode rows reading ``row_keys`` keys and prefill ``chunks``
        (each ``(context, tokens)``) took ``seconds``."""
        if seconds <= 0 or (rows <= 0 and not chunks):
            return
        if not chunks:
            dense = 1.0 if _dense(rows, self.packed_rows) else 0.0
            self.decode.observe((1.0, rows, row_keys, dense), seconds)
            return
        rest = seconds - self._decode_part(rows, row_keys)
        tokens = sum(t for _, t in chunks)
        keys = sum(chunk_keys(c, t) for c, t in chunks)
        self.chunks.observe((len(chunks), tokens, keys), rest)

    def _decode_part(self, rows: int, keys: int) -> float:
        """The decode rows' share of a step with chunks, at their own batch size: where a
        chunk takes the step onto the dense weights, the chunk fit absorbs the jump."""
        if not self.decode.measured:
            return 0.0
        return _decode_seconds(self.decode.fit(_DECODE_TRIES, 0), self.packed_rows, rows, keys)

    def fit(self) -> StepCost | None:
        """The fitted cost, or None before a step with prefill chunks was observed."""
        if not self.chunks.measured:
            return None
        base, per_row, per_row_key, dense = self.decode.fit(_DECODE_TRIES, 0)
        per_chunk, per_token, per_key = self.chunks.fit(((0, 1, 2), (1, 2), (0, 1), (1,)), 1)
        return StepCost(
            base, per_row, per_row_key, per_chunk, per_token, per_key, dense, self.packed_rows
        )


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Least-squares coefficients from the normal equations ``a c = b``; None when the
    features cannot be told apart. Each feature is scaled to unit size first (keys run to
    millions where the intercept's sum is about 10), so the test for a singular system
    means collinear features, not large numbers."""
    n = len(b)
    d = [math.sqrt(a[i][i]) for i in range(n)]
    if not all(d):
        return None
    m = [[a[i][j] / (d[i] * d[j]) for j in range(n)] + [b[i] / d[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] / d[i] for i in range(n)]


@dataclass(slots=True)
class StepRoom:
    """What is left of one step while the scheduler fills it with prefill chunks.

    ``tokens`` is what is left of ``max_num_batched_tokens``; ``seconds`` what is left of
    the time prefill may add to the step (None: the step is sized in tokens alone), and
    ``stretch_s`` what is left of the decode stretch, which binds a chunk only while
    ``stretched`` is True. ``cap_tokens`` and ``cap_s`` bound one request's chunk while
    others have work. The step's first ``floor`` prefill tokens are granted whatever the
    clock says (not past the token caps), so a long prompt still advances when the time
    target is tight; while ``full_floor`` is False a chunk is granted at most one token that
    way, and taking it spends the rest of the floor. The scheduler sets ``stretched`` and
    ``full_floor`` per chunk."""

    tokens: int
    cost: StepCost | None = None
    seconds: float | None = None
    cap_tokens: int = 1 << 30
    cap_s: float = math.inf
    floor: int = 0
    stretch_s: float = math.inf
    stretched: bool = True
    full_floor: bool = True

    def chunk(self, context: int, want: int, capped: bool = True) -> int:
        """Tokens (at most ``want``) for one chunk after ``context`` computed tokens."""
        n = min(want, self.tokens, self.cap_tokens) if capped else min(want, self.tokens)
        if self.seconds is not None and self.cost is not None:
            left = min(self.seconds, self.cap_s) if capped else self.seconds
            if self.stretched:
                left = min(left, self.stretch_s)
            floor = self.floor if self.full_floor else min(self.floor, 1)
            n = min(n, max(self.cost.chunk_tokens(left, context), floor))
        return max(n, 0)

    def take(self, context: int, tokens: int) -> None:
        self.tokens -= tokens
        # A chunk held to one token of the floor spends all of it: beside other tenants'
        # decodes the step's floor is one token for everyone but the least-served tenant.
        self.floor = max(0, self.floor - tokens) if self.full_floor else 0
        if self.seconds is not None and self.cost is not None:
            spent = self.cost.chunk_seconds(context, tokens)
            self.seconds -= spent
            self.stretch_s -= spent

    def is_open(self) -> bool:
        """Whether a one-token chunk at position 0 still fits, for a chunk not held to the
        decode stretch."""
        if self.tokens <= 0:
            return False
        if self.floor > 0 or self.seconds is None or self.cost is None:
            return True
        return self.cost.chunk_tokens(self.seconds, 0) > 0
