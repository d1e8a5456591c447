"""The step-overhead probe the benchmarks call."""

from __future__ import annotations

from service.engine.profile import measure_step_overhead
from service.model import LoadedModel


def test_measure_step_overhead_times_a_full_decode_batch(tiny: LoadedModel) -> None:
    engine_s, raw_s = measure_step_overhead(tiny, batch=4, context=40, repeats=3)
    assert engine_s > 0 and raw_s > 0
    # A step is the forward plus bookkeeping; on the tiny model bookkeeping dominates but
    # stays within a few milliseconds.
    assert engine_s < raw_s + 0.25
