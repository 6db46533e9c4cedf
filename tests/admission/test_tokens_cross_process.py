"""Token budgets across real processes (R-T1..R-T6, DESIGN.md section 6c): handler
processes of two generations draw on one budget of tokens, a request above the limits is
refused at once with the numbers, a SIGKILLed holder's tokens come back within the
sweep, and a handler of layout 3.1 registered beside them suspends the budget (said in
``availability``) until it is gone.

A handler of layout 3.1 is a registration that says minor 1 (``Core.register``'s
``minor``): the tests have no build of the 3.1 core to run, so its arrivals are made
here by the 3.2 core with no charge, as a 3.1 core makes them."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
from gwtest import Agent, P1Segment, availability, provider_of, publish_token_budget, run_cli

from handler_shim import Admission, RequestTooLarge
from shm_layout import layout, lock
from shm_layout.view import read_view

BUDGET, PER_REQUEST = 1000, 600


@pytest.fixture
def p1(p1_segment: Callable[..., P1Segment]) -> P1Segment:
    return p1_segment(4)


@pytest.fixture
def budget(p1: P1Segment) -> Iterator[Admission]:
    adm = p1.attach("publisher")
    publish_token_budget(adm, limit=4, tokens=BUDGET, per_request=PER_REQUEST)
    yield adm
    adm.close()


def _tokens(segment: str) -> tuple[int, int, int]:
    p = read_view(segment).provider("p1")
    assert p is not None
    return p.running, p.waiting, p.tokens_running


def _until(check: Callable[[], object], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_r_t3_r_t4_processes_share_one_budget_and_a_killed_holder_gives_it_back(
    p1: P1Segment, budget: Admission
) -> None:
    holders = [p1.handler("--gen", gen, "--tokens", "400", "hold") for gen in ("old", "new")]
    for agent in holders:
        agent.expect("admitted")
    assert _tokens(p1.name) == (2, 0, 800)
    waiter = p1.handler("--gen", "new", "--tokens", "400", "hold")
    # two slots are free, but 800 + 400 > 1000: it waits (R-T3)
    assert _until(lambda: _tokens(p1.name) == (2, 1, 800)), _tokens(p1.name)
    small = p1.handler("--gen", "old", "--tokens", "100", "hold")
    # 100 would fit, but a waiter is ahead of it: strict order, nobody overtakes
    assert _until(lambda: _tokens(p1.name) == (2, 2, 800)), _tokens(p1.name)
    os.kill(holders[0].pid, signal.SIGKILL)
    holders[0].proc.wait(timeout=10)
    waiter.expect("admitted", timeout=5.0)  # the dead holder's 400 came back in the sweep
    small.expect("admitted", timeout=5.0)
    assert _tokens(p1.name) == (3, 0, 900)
    doc = provider_of(availability(p1.name), "p1")
    assert (doc["tokens_running"], doc["token_limit"], doc["request_token_limit"]) == (
        900,
        BUDGET,
        PER_REQUEST,
    )
    assert doc["tokens_suspended"] is False


def test_r_t2_a_request_no_worker_can_hold_is_refused_at_once(
    p1: P1Segment, budget: Admission
) -> None:
    agent = p1.handler("--tokens", "700", "hold")
    refused = agent.expect("too_large", timeout=10.0)
    assert (refused["tokens"], refused["limit"]) == (700, PER_REQUEST)
    started = time.monotonic()
    with pytest.raises(RequestTooLarge) as caught, budget.slot_blocking("p1", tokens=700):
        pass
    assert time.monotonic() - started < 1.0  # at once: never queued, never a timeout
    assert "700 tokens" in str(caught.value) and "600" in str(caught.value)
    assert caught.value.provider == "p1" and caught.value.request_token_limit == PER_REQUEST
    assert _tokens(p1.name) == (0, 0, 0)


def test_r_t5_a_layout_3_1_handler_suspends_the_budget_and_availability_says_so(
    p1: P1Segment, budget: Admission
) -> None:
    first = p1.handler("--tokens", "550", "hold")
    first.expect("admitted")
    second = p1.handler("--tokens", "550", "hold")
    assert _until(lambda: _tokens(p1.name) == (1, 1, 550))
    seg = budget._seg
    older = lock.open_core(seg.name, seg.buf, seg.lock_kind)
    older.register(os.getpid(), 0.0, b"layout-3.1", layout.MAJOR, 1, 0.0)
    try:
        second.expect("admitted", timeout=5.0)  # slots alone while it is registered
        doc = provider_of(availability(p1.name), "p1")
        assert doc["tokens_suspended"] is True and doc["tokens_running"] == 1100
        text = run_cli("availability", "--segment", p1.name).stdout
        assert "tokens 1100/1000" in text and "SUSPENDED" in text
        with pytest.raises(RequestTooLarge):  # still more than any worker can hold
            budget.slot_blocking("p1", tokens=700).__enter__()
    finally:
        older.unregister(0.0)
        older.close()
    third = p1.handler("--tokens", "100", "hold")
    # the budget holds again: 1100 running, nothing more fits
    assert _until(lambda: _tokens(p1.name) == (2, 1, 1100))
    assert provider_of(availability(p1.name), "p1")["tokens_suspended"] is False
    for agent in (first, second, third):
        agent.send("release")
    third.expect("admitted", timeout=5.0)


def test_r_t6_wait_for_slot_tokens_gates_on_the_budget(p1: P1Segment, budget: Admission) -> None:
    holder: Agent = p1.handler("--tokens", "600", "hold")
    holder.expect("admitted")
    local = ("wait-for-slot", "--segment", p1.name, "--provider", "p1", "--quiet")
    assert run_cli(*local, "--check", "--tokens", "400").returncode == 0
    assert run_cli(*local, "--check", "--tokens", "500").returncode == 1  # 1100 > 1000
    never = run_cli(*local, "--check", "--tokens", "601")
    assert never.returncode == 2 and "can never fit" in never.stderr
