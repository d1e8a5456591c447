"""A tenant served more than the least-served decoding tenant, with a prompt running, keeps
the time of that prompt's prefill floor (``min_prefill_tokens``) out of the room the decode
guard leaves its own streams (``StepBudget.decode_rows``).

Driven by the real scheduler on a fake machine (tests/engine/scheduler_sim.py): a's 8
streams and b's 16 decode, b at half a's weight so it stays served more; then b sends one
more prompt. a's rows cost 18 ms, so the guard is 36 ms and the room it leaves 18 ms; all
24 rows cost 34 ms, so with b's streams first its prompt would get 2 ms a step (3 tokens),
and the floor's 16 tokens cost 5.8 ms."""

from __future__ import annotations

from tests.engine.scheduler_sim import Arrival, Sim, Step, machine, with_tuning


def _prompt_steps(prompt: int) -> list[Step]:
    """The steps that carried b's late prompt after the one that admitted it (a prompt is
    running from then on)."""
    arrivals = [Arrival(0.0, "a", 8, 200) for _ in range(8)]
    arrivals += [Arrival(0.0, "b", 8, 200) for _ in range(16)]
    arrivals.append(Arrival(0.5, "b", prompt, 1))
    sim = Sim(machine(10, 1, 0.3, 0.0, 0, 0), with_tuning(min_prefill_tokens=16),
              {"a": 1.0, "b": 0.5})
    sim.run(arrivals, max_steps=60)
    steps = [s for s in sim.steps[1:] if any(t == "b" for t, _, _ in s.chunks)]
    assert steps and all("a" in s.rows and s.served["b"] > s.served["a"] for s in steps)
    # The prompt runs for more than its last step, so the checks on steps[:-1] see some.
    assert len(steps) >= 3, steps
    return steps[1:]


def test_a_tenant_ahead_keeps_its_prompts_floor_out_of_its_streams_room() -> None:
    steps = _prompt_steps(150)
    assert all(sum(n for t, _, n in s.chunks if t == "b") >= 16 for s in steps[:-1]), steps
    assert len(steps) <= 10, len(steps)


def test_its_streams_keep_the_rest_of_the_room_within_the_guard() -> None:
    steps = _prompt_steps(150)
    # 18 ms of room less the floor's 5.8: 12 of b's rows (1 ms each), not all 16 nor none.
    assert all(10 <= len(s.rows.get("b", [])) < 16 for s in steps[:-1]), steps
    assert all(s.seconds <= 0.036 + 1e-3 for s in steps), steps
