"""The step cost model behind ``--max-step-ms`` and the decode stretch, on each hardware regime."""

from __future__ import annotations

import pytest

from service.engine.cost_model import Regime, StepCost, StepCostModel, chunk_keys

# A decode-only step: 20 ms + 1 ms per row + 1 us per key read.
DECODE = (0.020, 0.001, 1e-6)
# Each prefill chunk adds 2 ms + 0.5 ms per token + 2 us per key read.
CHUNK = (0.002, 0.0005, 2e-6)


def _step_s(rows: int, row_keys: int, chunks: list[tuple[int, int]]) -> float:
    seconds = DECODE[0] + DECODE[1] * rows + DECODE[2] * row_keys
    for context, tokens in chunks:
        seconds += CHUNK[0] + CHUNK[1] * tokens + CHUNK[2] * chunk_keys(context, tokens)
    return seconds


def _teach(model: StepCostModel, rounds: int = 4) -> None:
    for _ in range(rounds):
        for rows, keys in ((1, 30), (4, 900), (16, 1000), (8, 4000)):
            model.observe(rows, keys, [], _step_s(rows, keys, []))
        for rows, keys, chunks in (
            (1, 30, [(0, 64)]),
            (0, 0, [(500, 16)]),
            (2, 60, [(0, 8), (1200, 32)]),
            (0, 0, [(2000, 128), (10, 4), (300, 40)]),
        ):
            model.observe(rows, keys, chunks, _step_s(rows, keys, chunks))


def test_fits_the_decode_part_and_what_each_chunk_adds() -> None:
    model = StepCostModel()
    assert model.fit() is None  # nothing measured yet
    _teach(model)
    cost = model.fit()
    assert cost is not None
    fitted = (cost.base_s, cost.per_row_s, cost.per_row_key_s)
    assert fitted == pytest.approx(DECODE, rel=1e-6)
    fitted = (cost.per_chunk_s, cost.per_token_s, cost.per_key_s)
    assert fitted == pytest.approx(CHUNK, rel=1e-6)


def test_chunk_tokens_is_the_largest_chunk_within_the_time() -> None:
    cost = StepCost(0.020, 0.001, 1e-6, *CHUNK)
    for context in (0, 100, 1500, 3000):
        for seconds in (0.003, 0.010, 0.050):
            n = cost.chunk_tokens(seconds, context)
            assert cost.chunk_seconds(context, n) <= seconds + 1e-12
            assert cost.chunk_seconds(context, n + 1) > seconds
    # Later in a long prompt the same time buys fewer tokens (attention reads more keys).
    assert cost.chunk_tokens(0.020, 3000) < cost.chunk_tokens(0.020, 0) // 2
    assert cost.chunk_tokens(0.001, 0) == 0  # not even the chunk's own overhead fits


def test_follows_a_machine_that_got_slower() -> None:
    model = StepCostModel()
    _teach(model)
    fast = model.fit()
    for _ in range(40):  # every step now takes 3x as long
        for rows, keys in ((1, 30), (6, 500), (12, 3000)):
            model.observe(rows, keys, [], 3 * _step_s(rows, keys, []))
        for rows, keys, chunks in (
            (1, 30, [(0, 64)]),
            (0, 0, [(500, 16), (0, 200)]),
            (2, 60, [(1000, 24)]),
        ):
            model.observe(rows, keys, chunks, 3 * _step_s(rows, keys, chunks))
    slow = model.fit()
    assert fast is not None and slow is not None
    assert slow.decode_seconds(1, 30) == pytest.approx(3 * fast.decode_seconds(1, 30), rel=0.02)
    assert slow.chunk_seconds(100, 32) == pytest.approx(3 * fast.chunk_seconds(100, 32), rel=0.02)


def test_identical_steps_charge_their_time_per_token() -> None:
    model = StepCostModel()
    for _ in range(5):
        model.observe(0, 0, [(0, 50)], 0.05)
    cost = model.fit()
    assert cost is not None
    assert cost.chunk_seconds(0, 50) == pytest.approx(0.05)
    assert cost.per_token_s == pytest.approx(0.001)


def _two_regimes(rows: int, keys: int) -> float:
    """Packed weights serve up to 4 rows: 10 ms + 2 ms a row + 1 us a key; a bigger batch runs
    on the dense weights and takes 60 ms more."""
    return 0.010 + 0.002 * rows + 1e-6 * keys + (0.060 if rows > 4 else 0.0)


def _teach_regimes(model: StepCostModel, shapes: tuple[tuple[int, int], ...]) -> None:
    for _ in range(4):
        for rows, keys in shapes:
            model.observe(rows, keys, [], _two_regimes(rows, keys))
        model.observe(1, 30, [(0, 64)], _two_regimes(1, 30) + 0.01)


def test_the_jump_past_the_packed_rows_is_its_own_term() -> None:
    shapes = ((1, 30), (2, 500), (4, 900), (3, 100), (8, 4000), (12, 3000), (6, 200))
    model = StepCostModel(Regime(packed_rows=4))
    _teach_regimes(model, shapes)
    cost = model.fit()
    assert cost is not None and cost.dense_s == pytest.approx(0.060, rel=1e-6)
    for rows, keys in ((1, 100), (4, 2000), (5, 2000), (16, 5000)):
        assert cost.decode_seconds(rows, keys) == pytest.approx(_two_regimes(rows, keys), rel=1e-6)
    # One line through both regimes under-predicts the first dense step by a third: the
    # decode guard would let rows in that stretch the step far past its bound.
    flat = StepCostModel()
    _teach_regimes(flat, shapes)
    line = flat.fit()
    assert line is not None
    assert line.decode_seconds(5, 2000) < 0.8 * _two_regimes(5, 2000)


def test_before_a_dense_step_is_seen_the_packed_line_stands() -> None:
    model = StepCostModel(Regime(packed_rows=4))
    _teach_regimes(model, ((1, 30), (2, 500), (4, 900), (3, 100)))
    cost = model.fit()
    assert cost is not None and cost.dense_s == 0.0
    assert cost.decode_seconds(3, 400) == pytest.approx(_two_regimes(3, 400), rel=1e-6)


def test_a_chunk_stays_on_the_packed_weights_unless_the_time_pays_for_the_jump() -> None:
    # 1 ms a chunk, 0.5 ms a token; packed weights serve 40 tokens, a step past them
    # pays 30 ms more.
    cost = StepCost(0.010, 0.0, 0.0, 0.001, 0.0005, 0.0, 0.030, 0.030, Regime(packed_rows=40))
    # Beside 4 decode rows: 36 tokens stay packed. 10 ms buys 18 tokens: held there.
    assert cost.chunk_tokens(0.010, 0, step_tokens=4) == 18
    # 20 ms would buy 38 on one line, past the 36 the packed weights have room for, and
    # cannot pay the jump: the chunk keeps the step packed.
    assert cost.chunk_tokens(0.020, 0, step_tokens=4) == 36
    # 100 ms pays the 30 ms jump and more: (100 - 30 - 1) / 0.5 = 138 tokens, dense.
    assert cost.chunk_tokens(0.100, 0, step_tokens=4) == 138
    assert cost.chunk_seconds(0, 138, step_tokens=4) == pytest.approx(0.100)
    # A step already past the packed weights has no jump left to pay.
    assert cost.chunk_tokens(0.010, 0, step_tokens=50) == 18


def test_the_fit_learns_the_jump_a_chunk_pays_past_the_packed_weights() -> None:
    regime = Regime(packed_rows=40)
    truth = StepCost(0.010, 0.001, 0.0, 0.001, 0.0005, 0.0, 0.0, 0.030, regime)
    model = StepCostModel(regime)
    for _ in range(4):
        for rows in (1, 3, 8):
            model.observe(rows, 0, [], truth.decode_seconds(rows, 0))
        for rows, tokens in ((2, 8), (4, 30), (1, 100), (6, 64), (0, 20), (3, 200)):
            took = truth.decode_seconds(rows, 0) + truth.chunk_seconds(0, tokens, rows)
            model.observe(rows, 0, [(0, tokens)], took)
    fitted = model.fit()
    assert fitted is not None
    assert fitted.chunk_dense_s == pytest.approx(0.030, rel=1e-6)
    assert fitted.chunk_tokens(0.1003, 0, 4) == truth.chunk_tokens(0.1003, 0, 4) == 138


def test_a_decode_step_costs_what_its_cuda_graph_batch_costs() -> None:
    regime = Regime(graph_sizes=(1, 2, 4, 8, 16))
    cost = StepCost(0.002, 0.0001, 0.0, 0.0, 0.0, 0.0, regime=regime)
    # 5 rows replay the 8-row graph: they cost what 8 rows cost, and so does a 6th.
    assert cost.decode_seconds(5, 0) == cost.decode_seconds(8, 0) == pytest.approx(0.0028)
    assert regime.padded(17) == 17  # past the largest graph: eager, unpadded


def test_a_negligible_key_cost_does_not_wreck_the_chunk_size() -> None:
    # A fit can leave per_key_s at 1e-23: the chunk is what the per-token line allows.
    cost = StepCost(0.005, 0.0, 0.0, 0.001, 0.00005, 6e-23)
    assert cost.chunk_tokens(0.0025, 1) == 30
    assert cost.chunk_tokens(0.0065, 1000) == 110


def test_a_batch_size_seen_is_priced_at_its_own_time_not_the_line() -> None:
    """One row runs a memory-bound loop, a few share a tile: the cost is not linear in rows.
    After a long run of 8-14-row steps the line's intercept prices one row at what the
    tiles cost; the one-row steps seen before keep a lone row at its own time, so the
    decode guard (decode_stretch x a tenant's own rows) is not inflated by the others."""

    def truth(rows: int, keys: int) -> float:
        return (0.016 if rows == 1 else 0.028 + 0.0005 * rows) + 1e-6 * keys

    model = StepCostModel()
    for keys in (40, 80, 120):
        model.observe(1, keys, [], truth(1, keys))
    for i in range(200):
        rows = 8 + i % 7
        model.observe(rows, 600 + 10 * i, [], truth(rows, 600 + 10 * i))
    model.observe(1, 30, [(0, 16)], truth(1, 30) + 0.004)
    cost = model.fit()
    assert cost is not None
    assert cost.decode_seconds(1, 300) == pytest.approx(truth(1, 300), rel=1e-3)
    assert cost.decode_seconds(12, 2000) == pytest.approx(truth(12, 2000), rel=1e-3)
    line = cost.base_s + cost.per_row_s + cost.per_row_key_s * 300
    assert line > 1.5 * truth(1, 300)
