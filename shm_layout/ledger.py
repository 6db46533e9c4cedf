"""The holder-record protocol (R-A1..R-A6, R-A14, R-A16), in plain Python: the model.

Production runs the same operations in the compiled core (``_core.c``), under
the segment lock with the GIL released. This module is the protocol written
for people and for the tests: ``tests/shm/test_core_model.py`` drives both
with the same steps and requires the same bytes. It reads the rows as production
does, through ``rows.py`` (which readers use; nothing of production imports this model).

Invariants, per provider, whenever the segment lock is free (the segment is written
only by this protocol's steps; what a bad write can and cannot do is bounded below):

* ``running`` = number of RUNNING records, ``waiting`` = number of WAITING
  records (the counters are derived, and always written with their check word;
  :meth:`Ledger.recount_provider` rebuilds them from the records, and every sweep
  does: a mismatch is damage, counted, R-A16).
* ``waiting <= queue_bound`` (32): an arrival that would exceed it is refused.
* a new arrival is admitted at once only when nobody waits and
  ``running < limit``; otherwise it queues with the next ticket (FIFO).
* whenever ``running < limit`` and someone waits, the WAITING record with the
  smallest ticket is made RUNNING (:meth:`Ledger.pump`), unless its owner is
  dead: then it is freed instead. Its owner is woken after unlock (its waiting
  thread on the record's state word, or its process's doorbell).
* a record belongs to a registration (member row and its serial); it is alive
  exactly while that member row's lock byte is held (``lock.py``): the kernel's
  word alone. A row is handed to a new registration only after the old one's
  records are freed (``register``, ``reap``), so a held row's records are its
  holder's.
* the limit is the published one while its deadline (on the host's deadline
  clock) lies ahead, and no further ahead than any publication can set it;
  else the fallback (R-L7); either is clamped to 0..RUNNING_ROOM.

Damage (R-A16): only the segment owner's processes (and, group-shared, its group's)
can write the segment, and they are trusted not to lie. Against accidental damage the
steps check what no writer produces: counters that disagree with their check word or
are out of range (recounted before use), a state word that is none of the three
(freed), an ``in_use`` word that is neither 0 nor 1, a queue bound that is not
``QUEUE_BOUND``, a published deadline too far ahead (all put right by the sweep and
counted in ``damage``). A consistent lie (a record or counter rewritten to another
valid-looking value) is believed as written: it is out of scope.

Record transitions (all under the lock):

    FREE -> RUNNING     arrive(), admitted at once
    FREE -> WAITING     arrive(), queued
    WAITING -> RUNNING  pump(): granted to the head of the queue
    WAITING -> FREE     leave(): timeout or cancel before a grant;
                        cancel_waiting(): close() began (R-A14)
    RUNNING -> FREE     leave(): release, or a cancel that lost the race with a grant
                        (the slot is handed on by the pump that follows)
    any -> FREE         sweep()/reap() or register(): the owner is dead;
                        unregister(): close() cut what its grace did not see end
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from shm_layout import layout
from shm_layout.errors import ProviderIdError as ProviderIdError
from shm_layout.layout import (
    HOLDER,
    HOLDER_FREE,
    HOLDER_RUNNING,
    HOLDER_WAITING,
    HOLDERS_PER_PROVIDER,
    MEMBER,
    PROVIDER,
    PROVIDER_COUNT,
)
from shm_layout.rows import (
    DEADLINE_SLACK_S,
    encode_provider_id,
    holder_base,
    limit_value,
    member_base,
    provider_base,
)


def decide_arrival(running: int, waiting: int, limit: int, bound: int) -> Decision:
    """FIFO admission: nobody overtakes a waiter (R-A3), the queue is bounded (R-A2)."""
    if waiting == 0 and running < limit:
        return "admit"
    if waiting >= bound:
        return "full"
    return "wait"


# --- the model ------------------------------------------------------------------------
Decision = Literal["admit", "wait", "full", "wait_refused", "closed"]
Outcome = Literal["released", "timeout", "cancelled"]
Held = Callable[[int], bool]  # member row -> is its lock byte held (the kernel's word)


@dataclass(frozen=True, slots=True)
class Ticket:
    provider: int
    holder: int
    serial: int


class Ledger:
    """The admission operations on a buffer, with the kernel's word given by ``held``.

    Each public method is one locked step of the core, in the same order of
    writes; rings (members whose doorbells the core posts) are returned. Times
    are the deadline clock's (the model tests' synthetic clock is both clocks).
    """

    def __init__(self, buf: bytearray | memoryview, held: Held) -> None:
        self.buf = buf
        self.held = held
        self.damage = 0  # like the core's per-object count (R-A16)

    # liveness, as the core sees it
    def member_alive(self, m: int) -> bool:
        """The kernel's word alone: row ``m``'s lock byte is held (a row out of range:
        nobody can hold it). The row's in_use and serial words are not consulted."""
        return 0 <= m < layout.MEMBER_COUNT and self.held(m)

    def _holder_alive(self, hb: int) -> bool:
        return self.member_alive(HOLDER["member"].get(self.buf, hb))

    def _free_record(self, hb: int) -> None:
        HOLDER["state"].put(self.buf, HOLDER_FREE, hb)

    def _get(self, field: str, base: int) -> int:
        value: int = PROVIDER[field].get(self.buf, base)
        return value

    def _bump(self, field: str, base: int, by: int = 1) -> None:
        PROVIDER[field].put(self.buf, PROVIDER[field].get(self.buf, base) + by, base)

    def _peak(self, field: str, base: int, value: int) -> None:
        if value > PROVIDER[field].get(self.buf, base):
            PROVIDER[field].put(self.buf, value, base)

    def _put_counts(self, base: int, running: int, waiting: int) -> None:
        """running and waiting, always written with their check word."""
        PROVIDER["running"].put(self.buf, running, base)
        PROVIDER["waiting"].put(self.buf, waiting, base)
        PROVIDER["counts_check"].put(self.buf, layout.counts_check(running, waiting), base)

    def _counters_damaged(self, base: int) -> bool:
        """Out of range, or not what the check word written with them says (R-A16)."""
        running, waiting = self._get("running", base), self._get("waiting", base)
        return (
            running > HOLDERS_PER_PROVIDER
            or waiting > layout.QUEUE_BOUND
            or self._get("counts_check", base) != layout.counts_check(running, waiting)
        )

    # --- arrival --------------------------------------------------------------------
    def arrive(
        self,
        p: int,
        pid: int,
        member: int,
        member_serial: int,
        now: float,
        *,
        may_wait: bool = True,
        futex: bool = False,
        registered: bool = True,
    ) -> tuple[Decision, Ticket | None, set[int]]:
        """``registered`` False: the registration is gone or closing (R-A14)."""
        if not registered:
            return "closed", None, set()
        buf, base, rings = self.buf, provider_base(p), set[int]()
        for attempt in range(2):
            if self._counters_damaged(base) and self.recount_provider(p):
                self.damage += 1
            running, waiting = self._get("running", base), self._get("waiting", base)
            decision: Decision = decide_arrival(
                running, waiting, limit_value(buf, p, now), layout.QUEUE_BOUND
            )
            h = self._free_place(p) if decision != "full" else None
            if h is None:
                decision = "full"
            if decision == "full" and attempt == 0:
                if self.recount_provider(p):  # before refusing: are the counters true?
                    self.damage += 1
                continue
            if decision == "full":
                self._bump("rejected_total", base)
                return decision, None, rings
            if decision == "wait" and not may_wait:
                return "wait_refused", None, rings
            assert h is not None
            hb = holder_base(p, h)
            serial = HOLDER["serial"].get(buf, hb) + 1
            ticket = 0
            if decision == "wait":
                ticket = self._get("next_ticket", base)
                ticket = min(ticket + 1, 2**64 - 1)  # written to the top: it stays, never wraps
                PROVIDER["next_ticket"].put(buf, ticket, base)
            waker = layout.WAKE_FUTEX if futex else layout.WAKE_DOORBELL
            layout.HOLDER_BODY.pack_into(
                buf,
                hb + layout.HOLDER_BODY_OFFSET,
                pid,
                member_serial,
                ticket,
                serial,
                member,
                now,
                now,
                waker,
            )
            if decision == "admit":
                HOLDER["state"].put(buf, HOLDER_RUNNING, hb)  # state last
                self._put_counts(base, running + 1, waiting)
                self._peak("peak_running", base, running + 1)
                self._bump("admitted_total", base)
            else:
                HOLDER["state"].put(buf, HOLDER_WAITING, hb)
                self._put_counts(base, running, waiting + 1)
                self._peak("peak_waiting", base, waiting + 1)
            return decision, Ticket(p, h, serial), rings
        raise AssertionError("unreachable")

    def _free_place(self, p: int) -> int | None:
        for h in range(HOLDERS_PER_PROVIDER):
            if HOLDER["state"].get(self.buf, holder_base(p, h)) == HOLDER_FREE:
                return h
        return None

    # --- leaving --------------------------------------------------------------------
    def leave(
        self, t: Ticket, member: int, member_serial: int, outcome: Outcome, now: float
    ) -> tuple[str, set[int]]:
        """Free ``t``'s record if it is still this registration's: (what it was, rings)."""
        buf, base, hb = self.buf, provider_base(t.provider), holder_base(t.provider, t.holder)
        state = HOLDER["state"].get(buf, hb)
        if (
            HOLDER["serial"].get(buf, hb) != t.serial
            or state not in (HOLDER_RUNNING, HOLDER_WAITING)
            or HOLDER["member"].get(buf, hb) != member
            or HOLDER["member_serial"].get(buf, hb) != member_serial
        ):
            return "stale", set()
        if self._counters_damaged(base) and self.recount_provider(t.provider):
            self.damage += 1
        self._free_record(hb)
        running, waiting = self._get("running", base), self._get("waiting", base)
        if state == HOLDER_RUNNING:
            self._put_counts(base, max(running - 1, 0), waiting)
            self._note_hold(base, now - HOLDER["since_mono"].get(buf, hb))
            was = "running"
        else:
            self._put_counts(base, running, max(waiting - 1, 0))
            was = "waiting"
        if outcome == "timeout":
            self._bump("timeouts_total", base)
        elif outcome == "cancelled":
            self._bump("cancelled_total", base)
        return was, self.pump(t.provider, now)

    def _note_hold(self, base: int, hold: float) -> None:
        """The decayed mean hold time (for Retry-After); a negative or absurd hold (a
        stepped clock, garbage) is no sample."""
        if not 0.0 <= hold <= 86400.0:
            return
        mean = PROVIDER["hold_mean_s"].get(self.buf, base)
        if not 0.0 < mean <= 86400.0:
            mean = hold
        else:
            mean = mean + (hold - mean) * layout.HOLD_MEAN_WEIGHT
        PROVIDER["hold_mean_s"].put(self.buf, mean, base)

    def cancel_waiting(self, member: int, member_serial: int, now: float) -> tuple[int, set[int]]:
        """close() began: free this registration's WAITING records (R-A14)."""
        freed, rings = 0, set[int]()
        for p in self._providers():
            here = 0
            for h in range(HOLDERS_PER_PROVIDER):
                hb = holder_base(p, h)
                if (
                    HOLDER["member"].get(self.buf, hb) != member
                    or HOLDER["member_serial"].get(self.buf, hb) != member_serial
                ):
                    continue
                if HOLDER["state"].get(self.buf, hb) == HOLDER_WAITING:
                    self._free_record(hb)
                    here += 1
            if here:
                freed += here
                self._bump("cancelled_total", provider_base(p), here)
                self.recount_provider(p)
                rings |= self.pump(p, now)
        return freed, rings

    # --- granting -------------------------------------------------------------------
    def pump(self, p: int, now: float) -> set[int]:
        buf, base, rings = self.buf, provider_base(p), set[int]()
        if self._counters_damaged(base) and self.recount_provider(p):
            self.damage += 1
        running, waiting = self._get("running", base), self._get("waiting", base)
        if waiting == 0:
            return rings
        limit = limit_value(buf, p, now)
        recounted = False
        while running < limit and waiting > 0:
            # somebody waits by the counters and no record does: the records decide, once
            h = self._head_waiter(p)
            if h is None:
                if recounted:
                    break
                recounted = True
                self.recount_provider(p)
                running, waiting = self._get("running", base), self._get("waiting", base)
                continue
            hb = holder_base(p, h)
            waiting -= 1
            if not self._holder_alive(hb):
                self._free_record(hb)
                self._bump("reclaimed_total", base)
                continue
            HOLDER["since"].put(buf, now, hb)
            HOLDER["since_mono"].put(buf, now, hb)
            HOLDER["state"].put(buf, HOLDER_RUNNING, hb)
            running += 1
            rings.add(HOLDER["member"].get(buf, hb))
            self._bump("admitted_total", base)
        self._put_counts(base, running, waiting)
        self._peak("peak_running", base, running)
        return rings

    def _head_waiter(self, p: int) -> int | None:
        best: int | None = None
        best_ticket = 0
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if HOLDER["state"].get(self.buf, hb) == HOLDER_WAITING:
                ticket = HOLDER["ticket"].get(self.buf, hb)
                if best is None or ticket < best_ticket:
                    best, best_ticket = h, ticket
        return best

    def pump_all(self, now: float) -> set[int]:
        rings: set[int] = set()
        for p in self._providers():
            rings |= self.pump(p, now)
        return rings

    def _providers(self) -> list[int]:
        return [
            p for p in range(PROVIDER_COUNT) if PROVIDER["in_use"].get(self.buf, provider_base(p))
        ]

    # --- crash reclaim (R-A5), repair (R-A6), damage (R-A16) ------------------------
    def reap(self, now: float) -> tuple[int, set[int]]:
        """Free every record and member row of a dead process; then grant."""
        buf, reclaimed, rings = self.buf, 0, set[int]()
        for p in self._providers():
            freed = 0
            for h in range(HOLDERS_PER_PROVIDER):
                hb = holder_base(p, h)
                if HOLDER["state"].get(buf, hb) != HOLDER_FREE and not self._holder_alive(hb):
                    self._free_record(hb)
                    freed += 1
            if freed:
                reclaimed += freed
                self._bump("reclaimed_total", provider_base(p), freed)
                self.recount_provider(p)
            rings |= self.pump(p, now)
        for m in range(layout.MEMBER_COUNT):
            if MEMBER["in_use"].get(buf, member_base(m)) and not self.held(m):
                self._free_member_row(m)
        return reclaimed, rings

    def sweep(self, now: float) -> tuple[int, set[int]]:
        """What the host's sweep does (R-A5, R-A16): every provider's counters checked
        against its records, values no writer produces put right (an ``in_use`` word
        that is neither 0 nor 1 among them), then a reap."""
        buf = self.buf
        for p in self._providers():
            base = provider_base(p)
            if PROVIDER["in_use"].get(buf, base) != 1:  # claimed, but not by a word of ours
                PROVIDER["in_use"].put(buf, 1, base)
                self.damage += 1
            if PROVIDER["queue_bound"].get(buf, base) != layout.QUEUE_BOUND:
                PROVIDER["queue_bound"].put(buf, layout.QUEUE_BOUND, base)
                self.damage += 1
            if self.recount_provider(p):
                self.damage += 1
            if (
                PROVIDER["published_limit"].get(buf, base) >= 0
                and PROVIDER["expires_mono"].get(buf, base) - now > DEADLINE_SLACK_S
            ):
                PROVIDER["published_limit"].put(buf, -1, base)
                self.damage += 1
        reaped = self.reap(now)
        for m in range(layout.MEMBER_COUNT):
            if MEMBER["in_use"].get(buf, member_base(m)) > 1:  # held: the reap kept it
                MEMBER["in_use"].put(buf, 1, member_base(m))
                self.damage += 1
        return reaped

    def recount_provider(self, p: int) -> bool:
        """Rebuild the counters from the records (a state word that is none of FREE,
        WAITING, RUNNING is freed); True when something was wrong."""
        running = waiting = 0
        wrong = False
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            state = HOLDER["state"].get(self.buf, hb)
            if state not in (HOLDER_FREE, HOLDER_RUNNING, HOLDER_WAITING):
                self._free_record(hb)  # garbage: no writer wrote it
                state, wrong = HOLDER_FREE, True
            if state == HOLDER_RUNNING:
                running += 1
            elif state == HOLDER_WAITING:
                waiting += 1
        base = provider_base(p)
        wrong = wrong or (
            self._get("running", base) != running
            or self._get("waiting", base) != waiting
            or self._get("counts_check", base) != layout.counts_check(running, waiting)
        )
        self._put_counts(base, running, waiting)
        return wrong

    def repair(self) -> None:
        """What the next lock holder does after one died inside a section."""
        for p in self._providers():
            self.recount_provider(p)

    # --- members --------------------------------------------------------------------
    def _free_member_row(self, m: int) -> None:
        mb = member_base(m)
        MEMBER["in_use"].put(self.buf, 0, mb)
        MEMBER["bell"].put(self.buf, 0, mb)

    def drop_member_records(self, m: int, serial: int, now: float) -> set[int]:
        """Free the live records of registration (m, serial); recount and grant."""
        rings: set[int] = set()
        for p in self._providers():
            freed = False
            for h in range(HOLDERS_PER_PROVIDER):
                hb = holder_base(p, h)
                if (
                    HOLDER["state"].get(self.buf, hb) in (HOLDER_RUNNING, HOLDER_WAITING)
                    and HOLDER["member"].get(self.buf, hb) == m
                    and HOLDER["member_serial"].get(self.buf, hb) == serial
                ):
                    self._free_record(hb)
                    freed = True
            if freed:
                self.recount_provider(p)
                rings |= self.pump(p, now)
        return rings

    def register(
        self,
        pid: int,
        start: float,
        label: bytes,
        now: float,
        taken: Callable[[int], bool],
        bell: int = 0,
    ) -> tuple[int, int, set[int]]:
        """Claim a member row: (member, serial, rings), member -1 when full.

        ``taken(m)``: the row's lock byte cannot be had (held by this process already,
        or by another process that inherited a dead owner's descriptor).
        """
        buf, rings = self.buf, set[int]()
        for m in range(layout.MEMBER_COUNT):
            mb = member_base(m)
            old = MEMBER["serial"].get(buf, mb)
            if MEMBER["in_use"].get(buf, mb):
                if self.held(m):
                    continue
                rings |= self.drop_member_records(m, old, now)  # its owner died
                self._free_member_row(m)
            if taken(m):
                continue
            serial = old + 1
            MEMBER["pid"].put(buf, pid, mb)
            MEMBER["start"].put(buf, start, mb)
            MEMBER["serial"].put(buf, serial, mb)
            MEMBER["major"].put(buf, layout.MAJOR, mb)
            MEMBER["minor"].put(buf, layout.MINOR, mb)
            MEMBER["attached_at"].put(buf, now, mb)
            MEMBER["label"].put(buf, label[: layout.ID_BYTES], mb)
            MEMBER["bell"].put(buf, bell, mb)
            MEMBER["in_use"].put(buf, 1, mb)
            return m, serial, rings
        return -1, 0, rings

    def unregister(self, m: int, serial: int, now: float) -> set[int]:
        rings = self.drop_member_records(m, serial, now)
        mb = member_base(m)
        if MEMBER["serial"].get(self.buf, mb) == serial:
            MEMBER["in_use"].put(self.buf, 0, mb)
            MEMBER["bell"].put(self.buf, 0, mb)
        return rings

    def ensure_provider(
        self, provider_id: str, fallback: int, source: int, flags: int, reason: bytes
    ) -> tuple[int, bool]:
        wanted = encode_provider_id(provider_id).ljust(layout.ID_BYTES, b"\x00")
        for p in range(PROVIDER_COUNT):
            base = provider_base(p)
            if PROVIDER["in_use"].get(self.buf, base):
                if PROVIDER["id"].get(self.buf, base) == wanted:
                    return p, False
                continue
            PROVIDER["id"].put(self.buf, wanted, base)
            PROVIDER["queue_bound"].put(self.buf, layout.QUEUE_BOUND, base)
            self._put_counts(base, 0, 0)
            PROVIDER["published_limit"].put(self.buf, -1, base)
            PROVIDER["discovered"].put(self.buf, -1, base)
            PROVIDER["fallback_limit"].put(self.buf, fallback, base)
            PROVIDER["fallback_source"].put(self.buf, source, base)
            PROVIDER["flags"].put(self.buf, flags, base)
            PROVIDER["reason"].put(self.buf, reason[: layout.REASON_BYTES], base)
            PROVIDER["in_use"].put(self.buf, 1, base)
            return p, True
        return -1, False
