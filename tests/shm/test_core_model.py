"""The compiled core against its reference model (R-A1..R-A6): same steps, same bytes.

A hypothesis state machine drives arrivals, releases, timeouts, cancellations, limit
changes and expiries, reaps, holders' deaths at any step, a lock holder's death in the
middle of a section, and new registrations, on a real segment through the compiled core
(``shm_layout/_core.c``), and the same steps on a plain bytearray through the Python
model (``shm_layout/ledger.py``). After every step the admission bytes must be equal
and the invariants must hold: counters equal the records, waiting never above 32,
nobody waits while there is room, FIFO among the waiters of a provider, running never
raised above the limit in force by an admission. Runs on both lock kinds.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from shm_layout import _core, layout, ledger, lock, writer
from shm_layout.layout import HOLDER, HOLDER_FREE, HOLDER_RUNNING, HOLDER_WAITING, PROVIDER
from shm_layout.segment import Segment, unlink_segment

PROVIDERS = ("p0", "p1")
OUTCOMES = {"released": _core.RELEASED, "timeout": _core.TIMEOUT, "cancelled": _core.CANCELLED}
CODES = {
    _core.ADMIT: "admit",
    _core.WAIT: "wait",
    _core.FULL: "full",
    _core.WAIT_REFUSED: "wait_refused",
}
WAS = {0: "stale", 1: "running", 2: "waiting"}


class Member:
    """One registered 'process': its own core in this process (members of one process are
    alive to each other through the core's own table; a death drops the lock byte)."""

    def __init__(self, seg: Segment, pid: int, now: float) -> None:
        self.core = lock.open_core(seg.name, seg.buf, seg.lock_kind)
        self.pid = pid
        self.index, self.serial = self.core.register(
            pid, float(pid), b"gen", layout.MAJOR, layout.MINOR, now
        )
        assert self.index >= 0
        self.alive = True


class CoreAgainstModel(RuleBasedStateMachine):
    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.name = "/gwt-m" + secrets.token_hex(5)
        self.seg = Segment.open(self.name)
        self.members: list[Member] = []
        self.now = 1000.0
        self.unpumped = False  # time passed: a limit may have risen with nobody pumping yet

    @initialize()
    def setup(self) -> None:
        for i, pid in enumerate(PROVIDERS):
            p, _ = writer.ensure_provider(self.seg, pid, 2, "provider", False)
            assert p == i
        for pid in (101, 102, 103):
            self.members.append(Member(self.seg, pid, self.now))
        # the model starts from the very same bytes
        self.model_buf = bytearray(self.seg.buf[: layout.TOTAL_SIZE])
        self.model = ledger.Ledger(self.model_buf, self._model_alive)

    def _model_alive(self, m: int, serial: int) -> bool:
        return any(x.alive and x.index == m and x.serial == serial for x in self.members)

    def teardown(self) -> None:
        for m in self.members:
            if m.alive:
                m.core.unregister(self.now)
                m.core.close()
        self.seg.close()
        unlink_segment(self.name)

    # --- steps --------------------------------------------------------------------
    @rule(
        target=tickets,
        who=st.integers(0, 5),
        provider=st.sampled_from(range(len(PROVIDERS))),
        may_wait=st.booleans(),
        count=st.integers(1, 4),
    )
    def arrive(self, who: int, provider: int, may_wait: bool, count: int) -> Any:
        """Up to 4 arrivals in one step, so that queues form often."""
        return multiple(*(self._arrive(who + i, provider, may_wait) for i in range(count)))

    def _arrive(self, who: int, provider: int, may_wait: bool) -> Any:
        live = [m for m in self.members if m.alive]
        m = live[who % len(live)]
        ticket = _core.Ticket()
        code = m.core.arrive(ticket, provider, m.pid, self.now, may_wait, True, -1.0)
        decision, model_ticket, _ = self.model.arrive(
            provider, m.pid, m.index, m.serial, self.now, may_wait
        )
        assert CODES[code] == decision
        if model_ticket is not None:
            assert (ticket.provider, ticket.holder, ticket.serial) == (
                model_ticket.provider,
                model_ticket.holder,
                model_ticket.serial,
            )
        return (m, ticket, model_ticket)

    @rule(held=consumes(tickets), outcome=st.sampled_from(sorted(OUTCOMES)))
    def leave(self, held: Any, outcome: str) -> None:
        self._leave(held, outcome)

    @rule(held=consumes(tickets))
    def release(self, held: Any) -> None:
        """The common case, drawn as often as the rest together."""
        self._leave(held, "released")

    def _leave(self, held: Any, outcome: str) -> None:
        m, ticket, model_ticket = held
        if not m.alive or model_ticket is None:
            return
        was = m.core.leave(ticket, OUTCOMES[outcome], self.now, True)
        model_was, _ = self.model.leave(model_ticket, m.index, m.serial, outcome, self.now)  # type: ignore[arg-type]
        assert WAS[was] == model_was

    @rule(
        provider=st.sampled_from(range(len(PROVIDERS))),
        limit=st.integers(0, 5),
        ttl=st.integers(1, 40),
    )
    def publish(self, provider: int, limit: int, ttl: int) -> None:
        base = ledger.provider_base(provider)
        writes = [
            (
                base + PROVIDER["expires_at"].offset,
                PROVIDER["expires_at"].codec.pack(self.now + ttl),
            ),
            (
                base + PROVIDER["published_limit"].offset,
                PROVIDER["published_limit"].codec.pack(limit),
            ),
        ]
        assert self.seg.core.transact([], writes, True, self.now)
        for off, data in writes:
            self.model_buf[off : off + len(data)] = data
        self.model.pump_all(self.now)
        self.unpumped = False

    @rule(seconds=st.integers(1, 30))
    def time_passes(self, seconds: int) -> None:
        self.now += seconds  # an expiry is noticed by the next pump or reap
        self.unpumped = True

    @rule()
    def reap(self) -> None:
        reclaimed = self.seg.core.reap(self.now)
        model_reclaimed, _ = self.model.reap(self.now)
        assert reclaimed == model_reclaimed
        self.unpumped = False

    @precondition(lambda self: sum(m.alive for m in self.members) > 1)
    @rule(who=st.integers(0, 5))
    def a_process_dies(self, who: int) -> None:
        live = [m for m in self.members if m.alive]
        victim = live[who % len(live)]
        victim.core.abandon()
        victim.alive = False

    @rule(running=st.integers(0, 99))
    def a_lock_holder_dies_mid_section(self, running: int) -> None:
        self.seg.core.die_in_section(running)
        for p in range(len(PROVIDERS)):
            PROVIDER["running"].put(self.model_buf, running, ledger.provider_base(p))
        self.seg.core.snapshot()  # the next holder repairs before anything else
        self.model.repair()

    @precondition(lambda self: len(self.members) < 8)
    @rule()
    def a_process_registers(self) -> None:
        taken = {m.index for m in self.members if m.alive}
        pid = 200 + len(self.members)
        m_index, serial, _ = self.model.register(
            pid, float(pid), b"gen", self.now, lambda m: m in taken
        )
        member = Member(self.seg, pid, self.now)
        assert (member.index, member.serial) == (m_index, serial)
        self.members.append(member)

    # --- what must hold after every step ------------------------------------------
    @invariant()
    def same_bytes_as_the_model(self) -> None:
        if not hasattr(self, "model"):
            return
        real = bytes(self.seg.buf[: layout.TOTAL_SIZE])
        start = layout.PROVIDERS_BASE
        assert real[start:] == bytes(self.model_buf[start:]), self._first_difference(real)

    def _first_difference(self, real: bytes) -> str:
        for i, (a, b) in enumerate(zip(real, self.model_buf, strict=True)):
            if i >= layout.PROVIDERS_BASE and a != b:
                return f"first difference at byte {i}"
        return "no difference"

    @invariant()
    def counters_equal_records_and_bounds_hold(self) -> None:
        if not hasattr(self, "model"):
            return
        buf = self.seg.buf
        for p in range(len(PROVIDERS)):
            base = ledger.provider_base(p)
            states = [
                HOLDER["state"].get(buf, ledger.holder_base(p, h))
                for h in range(layout.HOLDERS_PER_PROVIDER)
            ]
            running, waiting = states.count(HOLDER_RUNNING), states.count(HOLDER_WAITING)
            assert all(s in (HOLDER_FREE, HOLDER_RUNNING, HOLDER_WAITING) for s in states)
            assert (PROVIDER["running"].get(buf, base), PROVIDER["waiting"].get(buf, base)) == (
                running,
                waiting,
            )
            assert waiting <= layout.QUEUE_BOUND  # R-A2
            limit = ledger.limit_value(buf, p, self.now)
            if waiting and not self.unpumped:  # R-A1/R-A3: nobody waits while there is room
                assert running >= limit, (p, running, waiting, limit)


@pytest.mark.parametrize("kind", ["robust-mutex", "lock-file"])
def test_the_core_does_what_the_model_does(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "lock-file":
        monkeypatch.setenv(lock.FORCE_LOCK_FILE_ENV, "1")
    else:
        monkeypatch.delenv(lock.FORCE_LOCK_FILE_ENV, raising=False)
    run_state_machine_as_test(
        CoreAgainstModel,
        settings=settings(
            max_examples=int(os.environ.get("GWCAP_MODEL_EXAMPLES", "200")),
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
