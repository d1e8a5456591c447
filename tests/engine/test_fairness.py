"""Weighted deficit round-robin over tenant queues."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from service.engine.fairness import FairQueue, TokenCounter


@dataclass(eq=False)
class Item:
    tenant: str
    cost: int
    name: str = ""


def drain(q: FairQueue[Item], n: int, eligible=lambda t: True) -> list[Item]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        item = q.peek(eligible)
        if item is None:
            break
        q.pop(item)
        out.append(item)
    return out


def test_weights_split_admitted_tokens_exactly_per_round() -> None:
    weights = {"a": 3.0, "b": 1.0}
    q: FairQueue[Item] = FairQueue(64, weights.__getitem__)
    for i in range(300):
        q.push(Item("a", 32, f"a{i}"))
        q.push(Item("b", 32, f"b{i}"))
    order = [x.tenant for x in drain(q, 160)]
    # quantum 64, cost 32: a admits 6 per visit, b admits 2.
    assert order[:8] == ["a"] * 6 + ["b"] * 2
    assert order.count("a") == 120
    assert order.count("b") == 40


def test_newcomer_waits_at_most_one_visit_of_the_others() -> None:
    q: FairQueue[Item] = FairQueue(128, lambda t: 1.0)
    for i in range(200):
        q.push(Item("a", 40, f"a{i}"))
    first = drain(q, 1)
    assert first[0].tenant == "a"
    for i in range(5):
        q.push(Item("b", 40, f"b{i}"))
    order = [x.tenant for x in drain(q, 30)]
    positions = [i for i, t in enumerate(order) if t == "b"]
    # a's visit holds 128 tokens = 3 requests of 40 (one already taken), then b gets 3.
    assert positions[:3] == [2, 3, 4]
    assert len(positions) == 5 and positions[-1] < 12


def test_ineligible_tenant_is_skipped_without_earning() -> None:
    q: FairQueue[Item] = FairQueue(10, lambda t: 1.0)
    q.push(Item("a", 10))
    q.push(Item("b", 10))
    got = q.peek(lambda t: t != "a")
    assert got is not None and got.tenant == "b"
    assert q.peek(lambda t: False) is None


def test_cost_above_quantum_skips_rounds_without_looping() -> None:
    q: FairQueue[Item] = FairQueue(1, lambda t: {"a": 1.0, "b": 0.25}[t])
    q.push(Item("a", 1000, "big"))
    q.push(Item("b", 100, "small"))
    # b needs 400 visits, a needs 1000: b goes first.
    assert [x.name for x in drain(q, 2)] == ["small", "big"]
    assert len(q) == 0


def test_front_push_remove_and_counts() -> None:
    q: FairQueue[Item] = FairQueue(100, lambda t: 1.0)
    a1, a2, a3 = Item("a", 5, "a1"), Item("a", 5, "a2"), Item("a", 5, "a3")
    for it in (a1, a2):
        q.push(it)
    q.push(a3, front=True)
    assert q.num_waiting("a") == 3 and len(q) == 3
    assert q.remove(a2) and not q.remove(a2)
    assert [x.name for x in drain(q, 5)] == ["a3", "a1"]
    assert q.num_waiting("a") == 0 and len(q) == 0
    with pytest.raises(ValueError):
        FairQueue(0, lambda t: 1.0)


def test_a_returning_tenant_gets_no_credit_for_idle_time() -> None:
    counter = TokenCounter(lambda tenant: 1.0)
    counter.charge("b", 500)
    counter.charge("c", 200)
    # With others active it starts level with the least served of them.
    counter.lift("a", ["b", "c"])
    assert counter["a"] == 200
    # With nobody else active (b between two requests) it starts level with the most served
    # tenant, so it is not served ahead of b's next decodes for b's past 500 tokens.
    counter.lift("d", [])
    assert counter["d"] == 500
    # A tenant already ahead keeps its own count.
    counter.charge("e", 900)
    counter.lift("e", ["b"])
    assert counter["e"] == 900
