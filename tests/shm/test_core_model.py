"""The compiled core against its reference model (R-A1..R-A6, R-A14, R-A16): same steps,
same bytes.

A hypothesis state machine drives arrivals, releases, timeouts, cancellations, limit
changes and expiries, reaps and sweeps, holders' deaths at any step, a lock holder's
death in the middle of a section, new registrations, and the moments of change: a
close that begins while others arrive and wait (its waiters freed, its arrivals
refused) and ends with slots still running, an event loop torn down with waiters, the
segment removed and made again under its name (arrivals told MOVED, running slots
finish), and damage (a bad write to a counter, its check word, a member's serial, an
in_use word, a published deadline, the lock word, a record's state word with garbage),
admission classes written, changed and removed under traffic (reserves, caps, promotion
after maxWait, displacement from a full queue, R-A17..R-A21) and handlers of the older
minor registering (the classes suspended while they are), and token budgets (DESIGN.md
section 6c, R-T1..R-T6): requests charged tokens, budgets published and expiring, a
request above them refused, a head that does not fit holding those behind it, the
charges of the dead returned by the sweep, handlers of 3.1 suspending the budget,
on a real segment through the compiled core (``shm_layout/_core.c``), and the same
steps on a plain bytearray through the Python model (``shm_layout/ledger.py``). Lies a
trusted writer could tell (a free record written back to life, a live record's state
or member serial written to another valid value) are drawn too: they are out of scope
by the threat model (docs/SECURITY.md), so nothing repairs them, but core and model must
still do the same with them, and raise nothing. After every step the admission bytes
must be equal and the invariants must hold: counters equal the records (after damage:
from the next step that touches the provider, or the next sweep), waiting never above
32, nobody waits while there is room, an admission never raises running above the
limit in force (after damage: never once a step has looked), no request runs without a
live record of its own (unless a lie or garbage was written over that record). Runs on
both lock kinds. (A clock step is no step here: the core
reads no wall clock, its deadlines are on one monotonic clock, which never steps; the
stepped wall clock is tested on real processes under faketime in
tests/admission/test_moments_of_change.py.)
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import pytest
from gwtest import core_hooks
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

from shm_layout import _core, layout, ledger, lock, rows, writer
from shm_layout.layout import (
    HOLDER,
    HOLDER_FREE,
    HOLDER_RUNNING,
    HOLDER_WAITING,
    MEMBER,
    PROVIDER,
)
from shm_layout.segment import Segment, unlink_segment

PROVIDERS = ("p0", "p1")  # claimed at the start; "p2" by a step, with its classes
LATE = "p2"
# class names a table is drawn from: an edit adds, removes, reorders and renames them
NAMES = ("vip", "interactive", "agent", "batch", "bulk")
CLASS_TABLES = st.lists(
    st.tuples(
        st.sampled_from(NAMES),
        st.integers(0, 3),
        st.integers(0, 3),
        st.sampled_from([0, 500, 5000]),
    ),
    max_size=layout.CLASS_COUNT,
    unique_by=lambda c: c[0],
)
OUTCOMES = {"released": _core.RELEASED, "timeout": _core.TIMEOUT, "cancelled": _core.CANCELLED}
CODES = {
    _core.ADMIT: "admit",
    _core.WAIT: "wait",
    _core.FULL: "full",
    _core.WAIT_REFUSED: "wait_refused",
    _core.CLOSED: "closed",
    _core.MOVED: "moved",
    _core.TOO_LARGE: "too_large",
}
CHARGES = st.sampled_from([0, 0, 40, 150, 300, 700])  # tokens a request is charged
WAS = {0: "stale", 1: "running", 2: "waiting"}


class Member:
    """One registered 'process': its own core in this process (members of one process are
    alive to each other through the core's own table; a death drops the lock byte)."""

    def __init__(self, seg: Segment, pid: int, now: float, minor: int = layout.MINOR) -> None:
        self.core = lock.open_core(seg.name, seg.buf, seg.lock_kind)
        self.pid = pid
        self.index, self.serial = self.core.register(
            pid, float(pid), b"gen", layout.MAJOR, minor, now
        )
        assert self.index >= 0
        self.alive = True
        self.closing = False
        self.retired = False  # the name leads to another segment: arrivals go there


class CoreAgainstModel(RuleBasedStateMachine):
    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.name = "/gwt-m" + secrets.token_hex(5)
        self.seg = Segment.open(self.name)
        self.members: list[Member] = []
        self.now = 1000.0
        self.unpumped = False  # time passed: a limit may have risen with nobody pumping yet
        self.damaged: set[int] = set()  # providers written over since a step looked at them
        self.uncounted: set[int] = set()  # providers with a record's state written, unswept
        self.overwritten: set[tuple[int, int, int]] = set()  # (p, h, serial) written over
        self.revived: dict[int, int] = {}  # provider -> waiters a lie made (not arrivals)
        self.running: list[Any] = []  # tickets whose bodies run: (member, ticket, model)
        self.issued: list[Any] = []  # every ticket that got a record: (member, ticket, model)
        self.replacement: Segment | None = None  # what the name leads to after a replace
        self.claimed: int | None = None  # the row a registration under way has taken
        self.rows = len(PROVIDERS)  # provider rows claimed so far
        # (p, h, serial) of each record an arrival made -> the name of the class it was
        # given, None for the default class (also once its class was gone from the table:
        # it counts in the default class from then on, whatever is written later)
        self.asked: dict[tuple[int, int, int], bytes | None] = {}

    @initialize()
    def setup(self) -> None:
        for i, pid in enumerate(PROVIDERS):
            p, _ = writer.ensure_provider(self.seg, pid, 2, layout.Source.PROVIDER, discovery=False)
            assert p == i
        for pid in (101, 102, 103):
            self.members.append(Member(self.seg, pid, self.now))
        # the model starts from the very same bytes
        self.model_buf = bytearray(self.seg.buf[: layout.TOTAL_SIZE])
        self.model = ledger.Ledger(self.model_buf, self._model_held)

    def _model_held(self, m: int) -> bool:
        """The kernel's word: some live process holds member row m's lock byte (one that
        registers holds it from the moment it takes the row, inside the section)."""
        return m == self.claimed or any(x.alive and x.index == m for x in self.members)

    def teardown(self) -> None:
        for m in self.members:
            if m.alive:
                m.core.unregister(self.now)
                m.core.close()
        self.seg.close()
        if self.replacement is not None:
            self.replacement.close()
        unlink_segment(self.name)

    # --- steps --------------------------------------------------------------------
    @precondition(lambda self: any(m.alive and not m.retired for m in self.members))
    @rule(
        target=tickets,
        who=st.integers(0, 5),
        provider=st.integers(0, len(PROVIDERS)),
        may_wait=st.booleans(),
        count=st.integers(1, 4),
        cls=st.integers(-1, 3),
        tokens=st.lists(CHARGES, min_size=4, max_size=4),
    )
    def arrive(
        self, who: int, provider: int, may_wait: bool, count: int, cls: int, tokens: list[int]
    ) -> Any:
        """Up to 4 arrivals in one step, so that queues form often."""
        provider %= self.rows
        return multiple(
            *(self._arrive(who + i, provider, may_wait, cls, tokens[i]) for i in range(count))
        )

    @precondition(lambda self: any(m.alive and not m.retired for m in self.members))
    @rule(
        target=tickets,
        who=st.integers(0, 5),
        provider=st.integers(0, len(PROVIDERS)),
        low=st.integers(-1, 3),
        high=st.integers(-1, 3),
    )
    def a_flood(self, who: int, provider: int, low: int, high: int) -> Any:
        """33 arrivals of one class, then 3 of another: the 32-bound reached, and a higher
        class displacing a lower one's waiters (R-A20)."""
        classes = [low] * 33 + [high] * 3
        provider %= self.rows
        return multiple(*(self._arrive(who + i, provider, True, c) for i, c in enumerate(classes)))

    def _arrive(
        self, who: int, provider: int, may_wait: bool, cls: int = -1, tokens: int = 0
    ) -> Any:
        live = [m for m in self.members if m.alive and not m.retired]
        m = live[who % len(live)]
        ticket = _core.Ticket(tokens=tokens)
        code = m.core.arrive(
            ticket, provider, m.pid, self.now, may_wait=may_wait, blocking=True, cls=cls
        )
        decision, model_ticket, _ = self.model.arrive(
            provider,
            m.pid,
            m.index,
            m.serial,
            self.now,
            may_wait=may_wait,
            registered=not m.closing,
            cls=cls,
            tokens=tokens,
        )
        assert CODES[code] == decision
        if decision == "too_large":  # R-T2: refused at once, and only when above a limit
            assert rows.too_large(tokens, rows.token_budget(self.seg.buf, provider, self.now))
        if decision != "closed":
            self.damaged.discard(provider)  # the arrival looked at this provider's counters
        if model_ticket is not None:
            self.issued.append((m, ticket, model_ticket))
            self.asked[(provider, model_ticket.holder, model_ticket.serial)] = self._class_of(
                provider, model_ticket.holder
            )
            assert (ticket.provider, ticket.holder, ticket.serial) == (
                model_ticket.provider,
                model_ticket.holder,
                model_ticket.serial,
            )
        if decision == "admit":
            # R-A1: an admission never raises running above the limit in force
            base = rows.provider_base(provider)
            running = PROVIDER["running"].get(self.seg.buf, base)
            assert running <= rows.limit_value(self.seg.buf, provider, self.now)
            self.running.append((m, ticket, model_ticket))
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
        self.running = [r for r in self.running if r[1] is not ticket]
        if not m.alive or model_ticket is None:
            return
        if not ticket.live:
            # left already (its loop was torn down): a second leave is a no-op, whatever
            # its old record now says (a bad write may have revived it with its serial);
            # the model's tickets carry no liveness, so it is not asked
            assert m.core.leave(ticket, OUTCOMES[outcome], self.now, blocking=True) == 0
            return
        was = m.core.leave(ticket, OUTCOMES[outcome], self.now, blocking=True)
        model_was, _ = self.model.leave(model_ticket, m.index, m.serial, outcome, self.now)  # type: ignore[arg-type]
        assert WAS[was] == model_was
        if model_was != "stale":
            self.damaged.discard(model_ticket.provider)  # the leave looked at its counters

    @rule(
        provider=st.sampled_from(range(len(PROVIDERS))),
        limit=st.integers(0, 5),
        ttl=st.integers(1, 40),
        tokens=st.sampled_from([0, 0, 400, 1000]),
        per_request=st.sampled_from([0, 250, 800]),
    )
    def publish(self, provider: int, limit: int, ttl: int, tokens: int, per_request: int) -> None:
        """A publication, with a token budget (0: none) and the most one request may hold
        (0: unknown), as the writer writes them: before the limit."""
        base = rows.provider_base(provider)
        writes = [
            (base + PROVIDER["token_limit"].offset, PROVIDER["token_limit"].codec.pack(tokens)),
            (
                base + PROVIDER["request_token_limit"].offset,
                PROVIDER["request_token_limit"].codec.pack(per_request),
            ),
            (
                base + PROVIDER["expires_mono"].offset,
                PROVIDER["expires_mono"].codec.pack(self.now + ttl),
            ),
            (
                base + PROVIDER["published_limit"].offset,
                PROVIDER["published_limit"].codec.pack(limit),
            ),
        ]
        self._publish(writes)

    @rule(provider=st.integers(0, len(PROVIDERS)), classes=CLASS_TABLES, default=st.integers(0, 5))
    def classes_are_written(
        self, provider: int, classes: list[tuple[str, int, int, int]], default: int
    ) -> None:
        """The writer's class table (name, reserve, cap, maxWait in ms), then a pump of
        every provider, as a publication does (none: back to one FIFO). Drawn from a few
        names, an edit adds, removes, reorders and renames classes under running and
        waiting requests: each keeps its class by name, or counts in the default class
        once its class is gone."""
        self._publish(writer.class_writes(provider % self.rows, classes, default))

    @precondition(lambda self: self.rows == len(PROVIDERS) and self.replacement is None)
    @rule(classes=CLASS_TABLES, default=st.integers(0, 5))
    def a_row_is_claimed_with_its_classes(
        self, classes: list[tuple[str, int, int, int]], default: int
    ) -> None:
        """A writer claims a new provider row: its classes are in it from the same step."""
        p, created = writer.ensure_provider(
            self.seg,
            LATE,
            2,
            layout.Source.PROVIDER,
            discovery=False,
            classes=classes,
            default_class=default,
        )
        rows_, default_row = writer.class_table(classes, default)
        model_p, model_created = self.model.ensure_provider(
            LATE,
            2,
            layout.SOURCE_CODES[layout.Source.PROVIDER],
            layout.PFLAG_CONFIGURED,
            layout.encode_text("static limit", layout.REASON_BYTES),
            b"".join(rows_),
            default_row,
        )
        assert (p, created) == (model_p, model_created) == (self.rows, True)
        self.rows += 1

    def _publish(self, writes: list[tuple[int, bytes]]) -> None:
        """What the writer's publication does: the writes and a pump of every provider, in
        one section of the core; the same writes and pump on the model."""
        assert self.seg.core.transact([], writes, True, self.now)
        assert self.model.transact([], writes, self.now)[0]
        for key, asked in self.asked.items():
            if asked is not None and asked not in self._class_names(key[0]):
                self.asked[key] = None
        self.unpumped = False
        self.damaged.clear()

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
        self.damaged -= set(range(self.rows)) - self.uncounted  # pumped: counters looked at

    @rule()
    def sweep(self) -> None:
        """The host's sweep: counters rebuilt from the records, values out of range put
        right, then a reap."""
        reclaimed = self.seg.core.sweep(self.now)
        model_reclaimed, _ = self.model.sweep(self.now)
        assert reclaimed == model_reclaimed
        self.unpumped = False
        self.damaged.clear()
        self.uncounted.clear()

    # --- the moments of change (R-A14) -------------------------------------------
    @precondition(lambda self: sum(m.alive and not m.closing for m in self.members) > 1)
    @rule(who=st.integers(0, 5))
    def a_close_begins(self, who: int) -> None:
        """close(): arrivals of that registration refused from now on, its waiters freed
        (a grant can never reach them any more); its running slots go on."""
        live = [m for m in self.members if m.alive and not m.closing]
        m = live[who % len(live)]
        freed = m.core.begin_close(self.now)
        model_freed, _ = self.model.cancel_waiting(m.index, m.serial, self.now)
        assert freed == model_freed
        m.closing = True

    @precondition(lambda self: any(m.alive and m.closing for m in self.members))
    @rule()
    def a_close_ends(self) -> None:
        """close() after its grace: unregister cuts what still runs."""
        m = next(m for m in self.members if m.alive and m.closing)
        expected = sum(
            1
            for p in range(self.rows)
            for h in range(layout.HOLDERS_PER_PROVIDER)
            if self._ours_running(rows.holder_base(p, h), m)
        )
        cut = m.core.unregister(self.now)
        self.model.unregister(m.index, m.serial, self.now)
        assert cut == expected
        m.alive = False
        m.core.close()
        self.running = [r for r in self.running if r[0] is not m]

    @rule(who=st.integers(0, 5))
    def a_loop_is_torn_down(self, who: int) -> None:
        """An event loop closed with tasks waiting in slot(): the shim frees each orphan's
        record as cancelled, one after another, even one granted meanwhile (R-A12,
        R-A14); its running slots go on. Releasing one later is a no-op (stale)."""
        waiting = [
            (m, t, mt) for m, t, mt in self.issued if m.alive and m.core.state(t) == HOLDER_WAITING
        ]
        if not waiting:
            return
        m = waiting[who % len(waiting)][0]  # a process with waiters: its loop goes away
        for owner, ticket, model_ticket in waiting:
            if owner is not m:
                continue
            self.running = [r for r in self.running if r[1] is not ticket]
            was = m.core.leave(ticket, _core.CANCELLED, self.now, blocking=True)
            model_was, _ = self.model.leave(model_ticket, m.index, m.serial, "cancelled", self.now)
            # freeing one orphan may grant the next one: freed all the same (unless its
            # record was written over)
            assert WAS[was] == model_was
            assert model_was in ("waiting", "running") or (
                (model_ticket.provider, model_ticket.holder, model_ticket.serial)
                in self.overwritten
            )
            if model_was != "stale":
                self.damaged.discard(model_ticket.provider)  # the leave looked at its counters

    @precondition(lambda self: self.replacement is None and any(m.alive for m in self.members))
    @rule()
    def the_name_is_replaced(self) -> None:
        """The segment removed by hand and made again under its name (R-A15): every
        registration sees that the name leads elsewhere; an arrival is told MOVED (CLOSED
        once its close began) and writes nothing here; what runs here finishes here (new
        processes attach to the new segment, which is not this machine's)."""
        unlink_segment(self.name)
        self.replacement = Segment.open(self.name)
        assert self.replacement.core is not None
        for m in self.members:
            if not m.alive:
                continue
            assert m.core.still_named() == 0
            m.core.retire()
            code = m.core.arrive(_core.Ticket(), 0, m.pid, 0.0, may_wait=True, blocking=True)
            assert code == (_core.CLOSED if m.closing else _core.MOVED) and m.core.moved
            m.retired = True
        assert self.replacement.core.still_named() == 1

    @rule(garbage=st.sampled_from([bytes(range(7, 47)), b"\xff" * 40]))
    def a_bad_write_to_the_lock_word(self, garbage: bytes) -> None:
        """Garbage in the robust mutex's bytes: refused as DamagedLock before glibc sees
        it, nothing written (R-A16); the operator's recovery puts the bytes back. The
        lock-file kind keeps no lock in these bytes: the step goes on as usual."""
        buf = self.seg.buf
        span = slice(layout.MUTEX_OFFSET, layout.MUTEX_OFFSET + len(garbage))
        before = bytes(buf[span])
        buf[span] = garbage
        try:
            if self.seg.lock_kind == layout.LOCK_ROBUST:
                with pytest.raises(_core.DamagedLock):
                    self.seg.core.sweep(self.now)
            else:
                self.sweep()
        finally:
            buf[span] = before

    def _ours_running(self, hb: int, m: Member) -> bool:
        buf = self.model_buf
        return bool(
            HOLDER["state"].get(buf, hb) == HOLDER_RUNNING
            and HOLDER["member"].get(buf, hb) == m.index
            and HOLDER["member_serial"].get(buf, hb) == m.serial
        )

    # --- damage (R-A16) ------------------------------------------------------------
    @rule(
        provider=st.sampled_from(range(len(PROVIDERS))),
        field=st.sampled_from(["running", "waiting", "counts_check", "next_ticket"]),
        value=st.sampled_from([0, 1, 33, 999, 0xFFFFFFFF]),
    )
    def a_bad_write_to_a_counter(self, provider: int, field: str, value: int) -> None:
        base = rows.provider_base(provider)
        value &= (1 << (8 * PROVIDER[field].codec.size)) - 1
        for buf in (self.seg.buf, self.model_buf):
            PROVIDER[field].put(buf, value, base)
        self.damaged.add(provider)

    @precondition(lambda self: any(m.alive for m in self.members))
    @rule(who=st.integers(0, 5))
    def a_bad_write_to_a_member_serial(self, who: int) -> None:
        live = [m for m in self.members if m.alive]
        m = live[who % len(live)]
        mb = rows.member_base(m.index)
        for buf in (self.seg.buf, self.model_buf):
            MEMBER["serial"].put(buf, MEMBER["serial"].get(buf, mb) + 1, mb)

    @precondition(lambda self: any(m.alive for m in self.members))
    @rule(
        table=st.sampled_from(["member", "provider"]),
        who=st.integers(0, 5),
        value=st.sampled_from([2, 7, 0xFFFFFFFF]),
    )
    def a_bad_write_to_an_in_use_word(self, table: str, who: int, value: int) -> None:
        """Neither 0 nor 1 in a claimed row's in_use: the sweep puts it back (R-A16)."""
        if table == "member":
            live = [m for m in self.members if m.alive]
            field, base = MEMBER["in_use"], rows.member_base(live[who % len(live)].index)
        else:
            field, base = PROVIDER["in_use"], rows.provider_base(who % len(PROVIDERS))
        for buf in (self.seg.buf, self.model_buf):
            field.put(buf, value, base)

    @rule(
        provider=st.sampled_from(range(len(PROVIDERS))),
        h=st.integers(0, 7),
        state=st.sampled_from([HOLDER_RUNNING, HOLDER_WAITING]),
    )
    def a_lie_revives_a_free_record(self, provider: int, h: int, state: int) -> None:
        """A free record written back to life (out of scope): it names its last owner and
        counts as that owner's while the owner lives; the sweep's recount counts it."""
        hb = rows.holder_base(provider, h)
        if HOLDER["state"].get(self.model_buf, hb) != HOLDER_FREE:
            return
        for buf in (self.seg.buf, self.model_buf):
            HOLDER["state"].put(buf, state, hb)
        self.uncounted.add(provider)
        self.overwritten.add((provider, h, HOLDER["serial"].get(self.model_buf, hb)))
        self.revived[provider] = self.revived.get(provider, 0) + 1

    @rule(
        provider=st.sampled_from(range(len(PROVIDERS))),
        h=st.integers(0, 7),
        state=st.sampled_from([HOLDER_FREE, HOLDER_RUNNING, HOLDER_WAITING, 7]),
    )
    def a_bad_write_to_a_live_records_state(self, provider: int, h: int, state: int) -> None:
        """state := garbage (7) on a record whose request runs or waits: no writer wrote
        it, so the next recount frees it and counts it as damage. state := FREE or the
        other live state is a lie (out of scope): believed as written."""
        hb = rows.holder_base(provider, h)
        was = HOLDER["state"].get(self.model_buf, hb)
        if was not in (HOLDER_RUNNING, HOLDER_WAITING):
            return
        for buf in (self.seg.buf, self.model_buf):
            HOLDER["state"].put(buf, state, hb)
        self.uncounted.add(provider)  # until the sweep has recounted
        if (was, state) == (HOLDER_RUNNING, HOLDER_WAITING):  # a waiter the bound never saw
            self.revived[provider] = self.revived.get(provider, 0) + 1
        self.overwritten.add((provider, h, HOLDER["serial"].get(self.model_buf, hb)))

    @rule(
        provider=st.sampled_from(range(len(PROVIDERS))),
        h=st.integers(0, 7),
        value=st.sampled_from([0, 1, 0xFFFFFFFF]),
    )
    def a_lie_to_a_live_records_member_serial(self, provider: int, h: int, value: int) -> None:
        """A live record's member serial written over (out of scope): the record is no
        longer its owner's to leave; it counts while its member row's holder lives."""
        hb = rows.holder_base(provider, h)
        if HOLDER["state"].get(self.model_buf, hb) not in (HOLDER_RUNNING, HOLDER_WAITING):
            return
        for buf in (self.seg.buf, self.model_buf):
            HOLDER["member_serial"].put(buf, value, hb)
        self.overwritten.add((provider, h, HOLDER["serial"].get(self.model_buf, hb)))

    @rule(provider=st.sampled_from(range(len(PROVIDERS))), limit=st.integers(0, 5))
    def a_deadline_too_far_ahead(self, provider: int, limit: int) -> None:
        """A published limit whose deadline no publication can set: never obeyed."""
        base = rows.provider_base(provider)
        for buf in (self.seg.buf, self.model_buf):
            PROVIDER["expires_mono"].put(buf, self.now + 3600.0, base)
            PROVIDER["published_limit"].put(buf, limit, base)
        self.unpumped = True  # the limit in force may have risen: the fallback applies

    @precondition(lambda self: sum(m.alive for m in self.members) > 1)
    @rule(who=st.integers(0, 5))
    def a_process_dies(self, who: int) -> None:
        live = [m for m in self.members if m.alive]
        victim = live[who % len(live)]
        core_hooks(victim.core).abandon()
        victim.alive = False

    @rule(running=st.integers(0, 99))
    def a_lock_holder_dies_mid_section(self, running: int) -> None:
        core_hooks(self.seg.core).die_in_section(running)
        for p in range(self.rows):
            PROVIDER["running"].put(self.model_buf, running, rows.provider_base(p))
        self.seg.core.snapshot()  # the next holder repairs before anything else
        self.model.repair()

    @precondition(lambda self: len(self.members) < 8 and self.replacement is None)
    @rule(minor=st.sampled_from([layout.MINOR, layout.MINOR, 1, 0]))
    def a_process_registers(self, minor: int) -> None:
        """A new handler; of layout 3.0 it suspends the classes and the token budget, of
        3.1 the token budget alone."""
        taken = {m.index for m in self.members if m.alive}
        pid = 200 + len(self.members)

        def taken_or_claimed(m: int) -> bool:
            if m in taken:
                return True
            self.claimed = m  # the model claims row m now: its lock byte is the new one's
            return False

        m_index, serial, _ = self.model.register(
            pid, float(pid), b"gen", self.now, taken_or_claimed, minor=minor
        )
        self.claimed = None
        member = Member(self.seg, pid, self.now, minor)
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
        for name in ("older_members", "tokenless_members"):
            older = layout.HEADER[name]
            assert older.get(self.seg.buf) == older.get(self.model_buf), name

    def _first_difference(self, real: bytes) -> str:
        for i, (a, b) in enumerate(zip(real, self.model_buf, strict=True)):
            if i >= layout.PROVIDERS_BASE and a != b:
                return f"first difference at byte {i}"
        return "no difference"

    @invariant()
    def no_body_runs_without_a_live_record(self) -> None:
        """Every admitted request whose owner lives and has not been cut has its record,
        RUNNING, with its serial (R-A14), unless that record was written over (R-A16:
        garbage there is freed, a lie is believed)."""
        if not hasattr(self, "model"):
            return
        for m, _ticket, model_ticket in self.running:
            hb = rows.holder_base(model_ticket.provider, model_ticket.holder)
            key = (model_ticket.provider, model_ticket.holder, model_ticket.serial)
            if not m.alive or key in self.overwritten:
                continue
            assert HOLDER["serial"].get(self.seg.buf, hb) == model_ticket.serial  # never reused
            assert HOLDER["state"].get(self.seg.buf, hb) == HOLDER_RUNNING

    def _class_names(self, p: int) -> list[bytes]:
        buf = self.model_buf
        count = min(PROVIDER["class_count"].get(buf, rows.provider_base(p)), layout.CLASS_COUNT)
        return [layout.CLASS["name"].get(buf, rows.class_base(p, k)) for k in range(count)]

    def _class_of(self, p: int, h: int) -> bytes | None:
        """The name of the class record h counts in by its cls byte; None: the default."""
        cls = HOLDER["cls"].get(self.model_buf, rows.holder_base(p, h))
        if not cls:
            return None
        name: bytes = layout.CLASS["name"].get(self.model_buf, rows.class_base(p, cls - 1))
        return name

    @invariant()
    def every_request_keeps_its_class_through_edits(self) -> None:
        """A running or waiting request stays in the class it was given, by name, whatever
        edits the table had since (rows added, removed, reordered, renamed); once its class
        is gone from the table it counts in the default class."""
        if not hasattr(self, "model"):
            return
        for (p, h, serial), asked in self.asked.items():
            hb = rows.holder_base(p, h)
            if (
                (p, h, serial) not in self.overwritten
                and HOLDER["serial"].get(self.model_buf, hb) == serial
                and HOLDER["state"].get(self.model_buf, hb) in (HOLDER_RUNNING, HOLDER_WAITING)
            ):
                assert self._class_of(p, h) == asked, (p, h, asked)

    @invariant()
    def counters_equal_records_and_bounds_hold(self) -> None:
        if not hasattr(self, "model"):
            return
        buf = self.seg.buf
        for p in range(self.rows):
            if p in self.damaged or p in self.uncounted:
                continue  # written over; the next step that looks (or the sweep) recounts
            base = rows.provider_base(p)
            states = [
                HOLDER["state"].get(buf, rows.holder_base(p, h))
                for h in range(layout.HOLDERS_PER_PROVIDER)
            ]
            running, waiting = states.count(HOLDER_RUNNING), states.count(HOLDER_WAITING)
            assert all(s in (HOLDER_FREE, HOLDER_RUNNING, HOLDER_WAITING) for s in states)
            charges = [
                HOLDER["tokens"].get(buf, rows.holder_base(p, h))
                for h in range(layout.HOLDERS_PER_PROVIDER)
            ]
            tokens_running = sum(
                c for c, s in zip(charges, states, strict=True) if s == HOLDER_RUNNING
            )
            # R-T4: the tokens in flight are the charges of the running records
            assert PROVIDER["tokens_running"].get(buf, base) == tokens_running
            assert (PROVIDER["running"].get(buf, base), PROVIDER["waiting"].get(buf, base)) == (
                running,
                waiting,
            )
            # R-A2; a record a lie revived is one the arrivals did not count (out of scope)
            assert waiting <= layout.QUEUE_BOUND + self.revived.get(p, 0)
            limit = rows.limit_value(buf, p, self.now)
            if self.unpumped or not waiting:
                continue
            count = rows.classes_in_force(buf, p)
            budget = rows.token_limit_in_force(buf, p, self.now)
            if not count:  # R-A1/R-A3: nobody waits while there is room
                if running < limit:  # R-T3: only because the head's tokens do not fit
                    head = min(
                        (HOLDER["ticket"].get(buf, rows.holder_base(p, h)), h)
                        for h, s in enumerate(states)
                        if s == HOLDER_WAITING
                    )[1]
                    assert not rows.tokens_fit(tokens_running, charges[head], budget), (
                        p,
                        running,
                        waiting,
                        limit,
                    )
                continue
            # R-A18/R-A19: no waiter that may run is left waiting
            rules = rows.class_rules(buf, p, count)
            run = [0] * count
            for h, state in enumerate(states):
                if state == HOLDER_RUNNING:
                    cls = HOLDER["cls"].get(buf, rows.holder_base(p, h))
                    run[rows.resolve_class(buf, p, cls - 1)] += 1
            for h, state in enumerate(states):
                if state != HOLDER_WAITING:
                    continue
                hb = rows.holder_base(p, h)
                k = rows.resolve_class(buf, p, HOLDER["cls"].get(buf, hb) - 1)
                wait = rules[k].max_wait_s
                promoted = (
                    k > 0 and wait > 0 and self.now - HOLDER["since_mono"].get(buf, hb) >= wait
                )
                if ledger.may_run(k, running, run, limit, rules, promoted=promoted):
                    # R-T3: a waiter the slots let run waits only for its tokens, or behind
                    # one of its rank or above that does
                    assert budget and any(
                        not rows.tokens_fit(tokens_running, charges[j], budget)
                        for j, s in enumerate(states)
                        if s == HOLDER_WAITING
                    ), (p, h, k, run)


@pytest.mark.timeout(900)  # 200 examples of 50 steps each, on a loaded 2-core machine
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
