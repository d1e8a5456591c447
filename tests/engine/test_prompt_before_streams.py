"""A tenant served more than the least-served decoding tenant, with a prompt running, keeps
``prompt_share`` of the room the decode guard leaves it for that prompt: its own streams
join within the rest (``StepBudget.decode_rows``), and the rows held back rejoin in what the
prompt's chunk leaves of the guard (``StepBudget.rejoin``).

Driven by the real scheduler on a fake machine (tests/engine/scheduler_sim.py): a's 8
streams and b's 16 decode, b at half a's weight so it stays served more; then b sends one
more prompt. a's rows cost 18 ms, so the guard is 36 ms and the room it leaves 18 ms; all
24 rows cost 34 ms, so with b's streams first its prompt would get 2 ms a step."""

from __future__ import annotations

from tests.engine.scheduler_sim import Arrival, Sim, Step, machine, with_tuning


def _prompt_steps(prompt: int, **tuning: float) -> list[Step]:
    """The steps that carried b's late prompt after the one that admitted it (a prompt is
    running from then on)."""
    arrivals = [Arrival(0.0, "a", 8, 200) for _ in range(8)]
    arrivals += [Arrival(0.0, "b", 8, 200) for _ in range(16)]
    arrivals.append(Arrival(0.5, "b", prompt, 1))
    sim = Sim(machine(10, 1, 0.3, 0.0, 0, 0), with_tuning(min_prefill_tokens=1, **tuning),
              {"a": 1.0, "b": 0.5})
    sim.run(arrivals, max_steps=60)
    steps = [s for s in sim.steps[1:] if any(t == "b" for t, _, _ in s.chunks)]
    assert steps and all("a" in s.rows and s.served["b"] > s.served["a"] for s in steps)
    return steps[1:]


def test_a_tenant_ahead_keeps_its_prompt_share_of_the_guard_room() -> None:
    steps = _prompt_steps(300)
    # 9 ms of the 18: (9 - 1) / 0.3 = 26-30 tokens a step, not the 2 ms streams leave.
    assert all(sum(n for t, _, n in s.chunks if t == "b") >= 25 for s in steps), steps
    assert len(steps) <= 12, len(steps)


def test_a_tenant_aheads_streams_keep_the_rest_of_the_room() -> None:
    steps = _prompt_steps(300)
    assert all(len(s.rows.get("b", [])) >= 8 for s in steps), steps
    for s in steps:  # and the step stays within the guard
        assert s.seconds <= 0.036 + 1e-3, s


def test_held_streams_rejoin_in_what_the_prompt_leaves() -> None:
    steps = _prompt_steps(20)
    assert len(steps) == 1, steps  # its last 17 tokens (6 ms) fit the prompt's 9 ms
    # 8 streams within the rest of the room, and more in what the chunk left.
    assert len(steps[0].rows["b"]) > 8, steps[0]
