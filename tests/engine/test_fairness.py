"""The fair share: one currency (weighted processed tokens) orders admission, chunks and
decode rows."""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.fairness import FairShare, Presence, TenantQueues, TokenCounter


@dataclass(eq=False)
class Item:
    tenant: str
    name: str = ""
    admit_order: int = 0


def test_admission_offers_the_least_served_eligible_tenant_first() -> None:
    q: TenantQueues[Item] = TenantQueues()
    for name in ("a1", "a2", "b1", "c1"):
        q.push(Item(name[0], name))
    served = {"a": 10.0, "b": 3.0, "c": 5.0}
    head = q.peek(lambda t: True, served.__getitem__)
    assert head is not None and head.name == "b1"
    # b at its running cap: the next least served is offered instead.
    head = q.peek(lambda t: t != "b", served.__getitem__)
    assert head is not None and head.name == "c1"
    # Each tenant's queue is served in order; a preempted request goes back in front.
    head = q.peek(lambda t: t == "a", served.__getitem__)
    assert head is not None and q.remove(head)
    back = Item("a", "a0")
    q.push(back, front=True)
    assert q.peek(lambda t: t == "a", served.__getitem__) is back
    assert (len(q), q.num_waiting("a"), q.tenants()) == (4, 2, ("a", "b", "c"))
    assert q.peek(lambda t: False, served.__getitem__) is None


def test_ties_go_to_the_tenant_that_queued_first() -> None:
    q: TenantQueues[Item] = TenantQueues()
    q.push(Item("b", "b1"))
    q.push(Item("a", "a1"))
    head = q.peek(lambda t: True, lambda t: 0.0)
    assert head is not None and head.name == "b1"


def test_processed_tokens_are_charged_by_weight_and_the_step_counts_what_it_gave() -> None:
    weights = {"heavy": 3.0, "light": 1.0}
    fair = FairShare(weights.__getitem__)
    fair.counter.charge("heavy", 300)
    fair.counter.charge("light", 100)
    assert fair.served("heavy") == fair.served("light") == 100.0
    fair.spend("light", 30)  # what the step being planned gave light so far
    assert fair.served("light") == 130.0
    assert fair.owed("heavy", {"light"}) and not fair.owed("light", {"heavy"})
    fair.new_step()
    assert fair.served("light") == 100.0


def test_a_tenant_is_level_within_a_steps_tokens_at_the_lighter_weight() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    fair = FairShare(weights.__getitem__)
    fair.counter.charge("a", 100)
    fair.counter.charge("b", 300)  # 150 counted
    fair.counter.charge("c", 164)
    assert fair.level("a", {"a", "b", "c"}, 64)  # the least served
    assert fair.level("c", {"a", "c"}, 64) and not fair.level("c", {"a", "c"}, 63)
    # b is 50 ahead of a; the lighter weight of the two (1) counts a step at 64 tokens.
    assert fair.level("b", {"a", "b"}, 50) and not fair.level("b", {"a", "b"}, 49)
    fair.spend("b", 2)  # what the step being planned gave counts
    assert not fair.level("b", {"a", "b"}, 50)


def test_decode_rows_least_served_first_and_the_others_take_turns() -> None:
    fair = FairShare(lambda t: 1.0)
    fair.counter.charge("a", 1000)
    rows = [Item("a", f"a{i}", i) for i in (1, 2, 3)] + [Item("b", "b4", 4)]
    first, rest = fair.decode_order(rows)
    assert [r.name for r in first] == ["b4"]
    assert [r.name for r in rest] == ["a1", "a2", "a3"]
    fair.ran("a", 2)  # a2 was the last of a's rows to run: a3 goes first next time
    assert [r.name for r in fair.decode_order(rows)[1]] == ["a3", "a1", "a2"]
    fair.idle("a")
    assert [r.name for r in fair.decode_order(rows)[1]] == ["a1", "a2", "a3"]


def test_a_tenant_between_requests_counts_as_present_for_the_grace_period() -> None:
    now = [0.0]
    presence = Presence(lambda: now[0], grace_s=2.0)
    presence.update(["a", "b"])
    now[0] = 1.5
    presence.update(["a"])
    assert presence.tenants() == {"a", "b"}  # b ended 1.5 s ago
    now[0] = 2.5
    presence.update(["a"])
    assert presence.tenants() == {"a"}


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
