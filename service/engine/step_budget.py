"""How many tokens a step may take so that it lasts about ``max_step_ms``.

Every token in a step (a decode row's one, a prefill chunk's many) costs about the same
forward work, so a step's wall time is close to ``base_s + per_token_s * tokens``. The model
is fitted online from the engine's own steps (exponentially weighted least squares, so it
follows a machine whose load changes) and the budget is the most tokens that fit the target.
Decodes keep a bounded inter-token gap this way while prefills still advance every step,
in the spirit of Sarathi-Serve's stall-free batching.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.9  # weight of the past per observed step


@dataclass(slots=True)
class StepCostModel:
    """``step_s ~ base_s + per_token_s * tokens``, from observed ``(tokens, seconds)``."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        d = _DECAY
        self.weight = d * self.weight + 1.0
        self.sum_x = d * self.sum_x + tokens
        self.sum_y = d * self.sum_y + seconds
        self.sum_xx = d * self.sum_xx + tokens * tokens
        self.sum_xy = d * self.sum_xy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(base_s, per_token_s)``, or None before anything was observed."""
        if self.weight == 0.0:
            return None
        mean_x = self.sum_x / self.weight
        mean_y = self.sum_y / self.weight
        var = self.sum_xx / self.weight - mean_x * mean_x
        if var > 1e-9 * max(1.0, mean_x * mean_x):
            slope = (self.sum_xy / self.weight - mean_x * mean_y) / var
            base = mean_y - slope * mean_x
            if slope > 0 and base >= 0:
                return base, slope
        # All steps alike (or a noisy fit): charge the whole time per token.
        return 0.0, mean_y / mean_x

    def budget(self, max_step_s: float, floor: int, ceiling: int) -> int:
        """Tokens a step may take to last about ``max_step_s``, within ``[floor, ceiling]``."""
        fitted = self.fit()
        if fitted is None:
            return floor  # unmeasured: start small; the first steps teach the model
        base, per_token = fitted
        tokens = int((max_step_s - base) / per_token)
        return max(floor, min(ceiling, tokens))
