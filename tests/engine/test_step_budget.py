"""The step cost model behind ``--max-step-ms``."""

from __future__ import annotations

import pytest

from service.engine.step_budget import StepCostModel


def test_fits_base_and_per_token_cost_and_sizes_the_budget() -> None:
    model = StepCostModel()
    for tokens in (1, 8, 64, 256, 16, 128) * 3:
        model.observe(tokens, 0.020 + 0.0005 * tokens)  # 20 ms + 0.5 ms per token
    base, per_token = model.fit() or (0.0, 0.0)
    assert base == pytest.approx(0.020, rel=1e-6)
    assert per_token == pytest.approx(0.0005, rel=1e-6)
    assert model.budget(0.100, floor=16, ceiling=512) == 160  # (100 - 20) / 0.5
    assert model.budget(0.010, floor=16, ceiling=512) == 16  # below the floor
    assert model.budget(1.000, floor=16, ceiling=512) == 512  # above the ceiling


def test_unmeasured_model_starts_at_the_floor_and_follows_a_slower_machine() -> None:
    model = StepCostModel()
    assert model.fit() is None and model.budget(0.1, 16, 512) == 16
    for tokens in (4, 64, 128) * 5:
        model.observe(tokens, 0.001 * tokens)
    fast = model.budget(0.1, 16, 512)
    for tokens in (4, 64, 128) * 20:  # the machine got 4x slower
        model.observe(tokens, 0.004 * tokens)
    slow = model.budget(0.1, 16, 512)
    assert fast == 100 and slow == pytest.approx(25, abs=1)


def test_identical_steps_charge_their_time_per_token() -> None:
    model = StepCostModel()
    for _ in range(5):
        model.observe(50, 0.05)
    assert model.fit() == (0.0, pytest.approx(0.001))
