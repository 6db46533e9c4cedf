"""One process, several users of the same lock target (R-A1, R-A5, R-A6).

With the lock-file kind (macOS, forced here), every lock is a POSIX record lock,
and POSIX drops *all* of a process's record locks on a file when the process closes
*any* descriptor of it. So a second attachment, or a reader (``read_view``, the
``availability`` code a handler may serve on its metrics page) in a process that is
registered, must never open-and-close the lock file: the process's member locks
would vanish, every other process would judge its slots dead and reclaim them
while it still runs them.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import pytest
from gwtest import Agent, P1Segment

from shm_layout.view import read_view


def _first_outcome(agent: Agent, timeout: float = 20.0) -> str:
    """The agent's first "admitted" or "timeout" event (a dead-judged holder is reaped
    within a second, so admission comes long before the agent's 3 s timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = agent.events.get(timeout=0.1)
        except queue.Empty:
            continue
        agent.seen.append(ev)
        if ev["event"] in ("admitted", "timeout", "eof"):
            return str(ev["event"])
    raise AssertionError(f"agent {agent.pid}: no outcome within {timeout}s: {agent.seen}")


@pytest.mark.parametrize("reopen", ["second-attach", "reader"])
def test_r_a1_a_second_attach_or_a_reader_in_a_holding_process_keeps_its_slot(
    reopen: str, lock_kind: str, p1_segment: Callable[..., P1Segment]
) -> None:
    """This process holds the only slot; then it attaches a second time, or reads the
    view (either opens the lock target again). Another process must still time out."""
    seg = p1_segment(1)
    first = seg.attach("first")
    second = None
    try:
        with first.slot_blocking("p1"):
            if reopen == "second-attach":
                second = seg.attach("second")
            else:
                p1 = read_view(seg.name).provider("p1")
                assert p1 is not None and p1.running == 1
            other = seg.handler("hold", "--timeout", "3")
            assert _first_outcome(other) == "timeout", other.seen  # not "admitted"
            p1 = read_view(seg.name).provider("p1")
            assert p1 is not None and (p1.running, p1.stored_running) == (1, 1)
    finally:
        if second is not None:
            second.close()
        first.close()
