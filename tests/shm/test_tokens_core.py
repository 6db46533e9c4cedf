"""Token budgets in the compiled core and its model, step by step (R-T1..R-T5, DESIGN.md
section 6c): a request above the limits refused at once, the tokens running counted and
given back, a head that does not fit holding those behind it (and nothing starving),
the classes' order held, a SIGKILLed holder's tokens returned by the sweep, the budget
lapsing with the published limit and suspended while a handler of layout 3.1 is
registered. Each step runs on a real segment through ``_core`` and on a copy through
``ledger.py``; the bytes must stay equal (the stateful test draws these steps at random:
this file pins the cases)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from core_twin import Twin

from shm_layout import layout, rows
from shm_layout.layout import PROVIDER


@pytest.fixture
def twin() -> Iterator[Twin]:
    t = Twin(limit=4)
    yield t
    t.close()


def test_r_t2_a_request_above_the_limits_is_refused_at_once(twin: Twin) -> None:
    twin.publish(limit=4, tokens=1000, per_request=256)
    assert twin.arrive(tokens=257)[0] == "too_large"  # above what one request may hold
    assert twin.arrive(tokens=256)[0] == "admit"
    twin.publish(limit=4, tokens=200)  # per request unknown: the whole budget bounds it
    assert twin.arrive(tokens=201)[0] == "too_large"
    assert PROVIDER["waiting"].get(twin.seg.buf, rows.provider_base(0)) == 0  # never queued


def test_r_t1_without_a_budget_tokens_change_no_decision(twin: Twin) -> None:
    """No budget in force (nothing published): the slots alone decide, yet the charges
    are counted, so a budget published later starts exact."""
    held = [twin.arrive(tokens=5000) for _ in range(5)]
    assert [d for d, _, _ in held] == ["admit"] * 4 + ["wait"]
    assert twin.tokens_running == 4 * 5000


def test_r_t3_a_head_that_does_not_fit_holds_those_behind_it(twin: Twin) -> None:
    twin.publish(limit=4, tokens=1000)
    big = twin.arrive(tokens=700)
    assert big[0] == "admit"
    large = twin.arrive(tokens=600)  # 700 + 600 > 1000: waits with a slot free
    small = twin.arrive(tokens=10)  # would fit, but a waiter is ahead of it: strict order
    assert (large[0], small[0]) == ("wait", "wait")
    assert twin.tokens_running == 700
    twin.leave(big)  # the head fits now, then the small one behind it
    assert (twin.state(large), twin.state(small)) == ("running", "running")
    assert twin.tokens_running == 610


def test_r_t3_nothing_starves_a_large_request(twin: Twin) -> None:
    """Small requests keep arriving while a large one waits: none of them overtakes it,
    and it runs once the tokens running before it have ended."""
    twin.publish(limit=4, tokens=1000, ttl=50.0)
    running = [twin.arrive(tokens=300) for _ in range(3)]
    large = twin.arrive(tokens=900)
    assert large[0] == "wait"
    later = [twin.arrive(tokens=50) for _ in range(3)]
    assert all(d == "wait" for d, _, _ in later)
    for held in running:
        twin.leave(held)
    assert twin.state(large) == "running"
    assert twin.tokens_running == 900 + 50 * 2  # two of the small ones fit beside it
    assert [twin.state(h) for h in later] == ["running", "running", "waiting"]


def test_r_t3_a_charge_above_a_fallen_budget_runs_alone(twin: Twin) -> None:
    """Queued under a budget that then fell below its charge: it runs once nothing else
    does (never waits for ever)."""
    twin.publish(limit=4, tokens=1000)
    first = twin.arrive(tokens=500)
    queued = twin.arrive(tokens=800)
    assert queued[0] == "wait"
    twin.publish(limit=4, tokens=600)
    twin.leave(first)
    assert twin.state(queued) == "running"
    assert twin.arrive(tokens=10)[0] == "wait"  # nothing fits beside it under the lower budget


def test_r_t4_a_killed_holders_tokens_come_back_in_the_sweep(twin: Twin) -> None:
    other = twin.register()
    twin.publish(limit=4, tokens=1000, ttl=50.0)
    doomed = twin.arrive(tokens=900, who=other)
    waiter = twin.arrive(tokens=500)
    assert (doomed[0], waiter[0]) == ("admit", "wait")
    twin.die(other)
    twin.sweep()
    assert twin.state(waiter) == "running"
    assert twin.tokens_running == 500


def test_r_t3_classes_keep_their_order_under_tokens(twin: Twin) -> None:
    """A waiter of the top class held back by tokens: a lower class does not slip past it
    though its own request would fit."""
    twin.classes([("interactive", 0, 0, 0), ("batch", 0, 0, 0)], 1)
    twin.publish(limit=4, tokens=1000)
    first = twin.arrive(tokens=600, cls=1)
    top = twin.arrive(tokens=500, cls=0)
    assert top[0] == "wait"
    assert twin.arrive(tokens=100, cls=1)[0] == "wait"
    twin.leave(first)
    assert twin.state(top) == "running"


def test_r_t1_the_budget_lapses_with_the_published_limit(twin: Twin) -> None:
    twin.publish(limit=4, tokens=100, ttl=5.0)
    assert twin.arrive(tokens=200)[0] == "too_large"
    twin.now += 10.0  # expired: the fallback, slots alone
    assert twin.arrive(tokens=200)[0] == "admit"


def test_r_t5_a_layout_3_1_handler_suspends_the_budget(twin: Twin) -> None:
    twin.publish(limit=4, tokens=1000, ttl=50.0)
    assert twin.arrive(tokens=800)[0] == "admit"
    blocked = twin.arrive(tokens=800)
    assert blocked[0] == "wait"
    older = twin.register(minor=1)  # it knows slots, not tokens: the budget is suspended
    assert layout.HEADER["tokenless_members"].get(twin.seg.buf) == 1
    assert layout.HEADER["older_members"].get(twin.seg.buf) == 0  # classes still hold
    assert twin.state(blocked) == "running"  # the suspension pumped: slots alone
    assert twin.arrive(tokens=2000)[0] == "too_large"  # still more than any worker holds
    twin.unregister(older)
    assert layout.HEADER["tokenless_members"].get(twin.seg.buf) == 0
    assert twin.tokens_running == 1600  # recounted from the records
    assert twin.arrive(tokens=10)[0] == "wait"  # the budget holds again
