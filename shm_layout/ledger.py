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
* a new arrival first grants what the limit allows (:meth:`Ledger.pump`), then is
  admitted at once only when ``running < limit`` (so nobody waits); otherwise it
  queues with the next ticket (FIFO). (With admission classes, below: when its class
  may run; no waiter that may run waits.) One decision serves both: the FIFO is the
  classed arrival with no classes (:meth:`Ledger._decide`).
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
    WAITING -> FREE     arrive() with classes: displaced from a full queue by a higher
                        class (its ``displaced`` byte set: its owner's wait ends QueueFull)

Admission classes (docs/DESIGN.md section 6b): with ``class_count`` 0, or while a
handler of an older minor is registered (``older_members``), every step is the FIFO
above, byte for byte. With classes in force only ``arrive`` and ``pump`` differ: a
record may run when the total is below the limit, its class below its cap, and (unless
it waited its class's ``maxWait``: promoted) the total plus every higher class's unused
reserve below the limit (:func:`may_run`); the pump grants the waiter of the highest rank
that may run, oldest first; an arrival pumps, then runs at once when it may; a full
queue displaces the newest waiter of the lowest rank below the arrival's.
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
    ClassRule,
    class_base,
    class_rules,
    classes_in_force,
    encode_provider_id,
    holder_base,
    limit_value,
    member_base,
    provider_base,
    resolve_class,
    stored_class,
    token_budget,
    token_limit_in_force,
    tokens_fit,
    too_large,
)


def may_run(
    c: int, running: int, run: list[int], limit: int, rules: list[ClassRule], *, promoted: bool
) -> bool:
    """May a request of class ``c`` take a slot now? The total below the limit, the class
    below its cap, and (unless promoted) the total plus every higher class's unused
    reserve below the limit: strict order when the reserves exceed the limit."""
    if running >= limit:
        return False
    if rules[c].cap and run[c] >= rules[c].cap:
        return False
    if promoted:
        return True
    withheld = sum(max(rules[k].reserve - run[k], 0) for k in range(c))
    return running + withheld < limit


ONE_FIFO = [ClassRule(0, 0, 0.0)]  # no classes in force: one class, no reserve, cap, maxWait


# --- the model ------------------------------------------------------------------------
Decision = Literal["admit", "wait", "full", "wait_refused", "closed", "too_large"]
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

    def _add_tokens(self, base: int, charge: int) -> None:
        """A record's charge into ``tokens_running``, saturating at the field's top."""
        total = self._get("tokens_running", base) + charge
        PROVIDER["tokens_running"].put(self.buf, min(total, 0xFFFFFFFF), base)

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
        cls: int = -1,
        tokens: int = 0,
    ) -> tuple[Decision, Ticket | None, set[int]]:
        """``registered`` False: the registration is gone or closing (R-A14). ``cls``: the
        class index asked for (-1 or unknown: the provider's default class).

        The arrival pumps first (a limit may have risen, a waiter may have been promoted
        meanwhile), then takes one decision (:meth:`_decide`), the FIFO being its case
        without classes.

        ``tokens``: the request's charge (0: slots only). One no worker could hold is
        refused at once (``too_large``); else it runs only when its tokens fit too, and
        never past a waiter (strict order: a head that does not fit holds those behind)."""
        if not registered:
            return "closed", None, set()
        buf, base = self.buf, provider_base(p)
        if too_large(tokens, token_budget(buf, p, now)):
            return "too_large", None, set()
        count = classes_in_force(buf, p)
        c, stored = resolve_class(buf, p, cls) if count else 0, stored_class(buf, p, cls)
        if self._counters_damaged(base) and self.recount_provider(p):
            self.damage += 1
        rings = self.pump(p, now)
        rules = class_rules(buf, p, count) or ONE_FIFO
        for attempt in range(2):
            running, waiting = self._get("running", base), self._get("waiting", base)
            limit = limit_value(buf, p, now)
            budget = token_limit_in_force(buf, p, now)
            fits = tokens_fit(self._get("tokens_running", base), tokens, budget)
            decision, victim = self._decide(
                p, c, rules, count, running, waiting, limit, now, fits=fits, budget=budget
            )
            h = self._free_place(p) if decision != "full" else None
            if h is None:
                h = victim
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
            if victim is not None:
                vb = holder_base(p, victim)
                self._free_record(vb)
                HOLDER["displaced"].put(buf, 1, vb)
                waiting -= 1
                self._put_counts(base, running, waiting)
                self._bump("displaced_total", base)
                self._bump("rejected_total", base)
                rings.add(HOLDER["member"].get(buf, vb))
            waker = layout.WAKE_FUTEX if futex else layout.WAKE_DOORBELL
            serial = self._claim_record(
                p,
                h,
                decision,
                running,
                waiting,
                pid,
                member,
                member_serial,
                now,
                waker,
                stored,
                tokens,
            )
            if decision == "admit" and count:
                self._bump_class(p, c)
            return decision, Ticket(p, h, serial), rings
        raise AssertionError("unreachable")

    def _decide(
        self,
        p: int,
        c: int,
        rules: list[ClassRule],
        count: int,
        running: int,
        waiting: int,
        limit: int,
        now: float,
        *,
        fits: bool = True,
        budget: int = 0,
    ) -> tuple[Decision, int | None]:
        """An arrival of class ``c``, after the pump: (decision, the waiter it displaces
        from a full queue, or None). Admitted when its class may run, else queued; from a
        full queue it displaces the newest waiter of the lowest rank below ``c`` (none:
        refused). Without classes in force (``count`` 0) it is class 0 of one with no
        reserve, cap or maxWait: admitted while running < limit, which the pump leaves
        only with nobody waiting (R-A3), refused when 32 wait (R-A2). The counts by class
        are read only for a class below the top or one with a cap, or to find a waiter.

        With a token budget it runs only when its tokens fit and it overtakes no waiter
        that only tokens hold back: without classes any waiter (the pump leaves one only
        then), with them one of its rank or above that the slots let run."""
        classed_budget = budget and count
        run = (
            self._class_running(p, count)
            if c > 0 or rules[c].cap or classed_budget
            else [0] * len(rules)
        )
        if may_run(c, running, run, limit, rules, promoted=False) and fits:
            held_back = False
            if budget and not count:
                held_back = waiting > 0
            elif classed_budget:
                h, _, _, _ = self._best_waiter(p, running, run, limit, rules, now)
                held_back = (
                    h is not None and self._rank(p, holder_base(p, h), rules, count, now)[1] <= c
                )
            if not held_back:
                return "admit", None
        if waiting < layout.QUEUE_BOUND:
            return "wait", None
        victim = self._displaceable(p, c, count, rules, now)
        return ("full" if victim is None else "wait"), victim

    def _claim_record(
        self,
        p: int,
        h: int,
        decision: Decision,
        running: int,
        waiting: int,
        pid: int,
        member: int,
        member_serial: int,
        now: float,
        waker: int,
        stored: int,
        tokens: int = 0,
    ) -> int:
        """Write free record ``h`` for an arrival, admitted or queued with the next
        ticket, and count it; its new serial."""
        buf, base, hb = self.buf, provider_base(p), holder_base(p, h)
        serial: int = HOLDER["serial"].get(buf, hb) + 1
        ticket = 0
        if decision == "wait":
            ticket = self._get("next_ticket", base)
            ticket = min(ticket + 1, 2**64 - 1)  # written to the top: it stays, never wraps
            PROVIDER["next_ticket"].put(buf, ticket, base)
        layout.HOLDER_BODY.pack_into(
            buf,
            hb + layout.HOLDER_BODY_OFFSET,
            pid,
            member_serial,
            ticket,
            serial,
            member,
            tokens,
            now,
            now,
            waker,
            stored,
            0,
        )
        if decision == "admit":
            HOLDER["state"].put(buf, HOLDER_RUNNING, hb)  # state last
            self._put_counts(base, running + 1, waiting)
            self._add_tokens(base, tokens)
            self._peak("peak_running", base, running + 1)
            self._bump("admitted_total", base)
        else:
            HOLDER["state"].put(buf, HOLDER_WAITING, hb)
            self._put_counts(base, running, waiting + 1)
            self._peak("peak_waiting", base, waiting + 1)
        return serial

    def _bump_class(self, p: int, c: int) -> None:
        field, cb = layout.CLASS["admitted_total"], class_base(p, c)
        field.put(self.buf, field.get(self.buf, cb) + 1, cb)

    def _record_class(self, p: int, hb: int, count: int) -> int:
        """The class a record's cls byte counts in with ``count`` classes in force: class
        0 when none are (their rows may be written while an older minor suspends them)."""
        return resolve_class(self.buf, p, HOLDER["cls"].get(self.buf, hb) - 1) if count else 0

    def _class_running(self, p: int, count: int) -> list[int]:
        run = [0] * max(count, 1)
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if HOLDER["state"].get(self.buf, hb) == HOLDER_RUNNING:
                run[self._record_class(p, hb, count)] += 1
        return run

    def _rank(
        self, p: int, hb: int, rules: list[ClassRule], count: int, now: float
    ) -> tuple[int, int, bool]:
        """A waiting record's (class, rank, promoted): promoted after its class's maxWait
        ranks as the top class."""
        k = self._record_class(p, hb, count)
        wait = rules[k].max_wait_s
        promoted = k > 0 and wait > 0 and now - HOLDER["since_mono"].get(self.buf, hb) >= wait
        return k, 0 if promoted else k, promoted

    def _displaceable(
        self, p: int, c: int, count: int, rules: list[ClassRule], now: float
    ) -> int | None:
        """The newest waiter of the lowest rank below class ``c``, or None."""
        best: int | None = None
        best_key = (0, 0)
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if HOLDER["state"].get(self.buf, hb) != HOLDER_WAITING:
                continue
            _, rank, _ = self._rank(p, hb, rules, count, now)
            key = (rank, HOLDER["ticket"].get(self.buf, hb))
            if rank > c and (best is None or key > best_key):
                best, best_key = h, key
        return best

    def _free_place(self, p: int) -> int | None:
        """The first free record; one that holds a displacement note (its owner may not
        have read it yet) only when no other is free."""
        noted = None
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if HOLDER["state"].get(self.buf, hb) == HOLDER_FREE:
                if not HOLDER["displaced"].get(self.buf, hb):
                    return h
                if noted is None:
                    noted = h
        return noted

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
            tokens_running = self._get("tokens_running", base)
            charge = HOLDER["tokens"].get(buf, hb)
            PROVIDER["tokens_running"].put(buf, max(tokens_running - charge, 0), base)
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
            here = self._free_own_records(p, member, member_serial, (HOLDER_WAITING,))
            if here:
                freed += here
                self._bump("cancelled_total", provider_base(p), here)
                self.recount_provider(p)
                rings |= self.pump(p, now)
        return freed, rings

    # --- a writer's transaction ----------------------------------------------------
    def transact(
        self,
        guards: list[tuple[int, bytes]],
        writes: list[tuple[int, bytes]],
        now: float,
        *,
        pump: bool = True,
        sweep: bool = False,
    ) -> tuple[bool, set[int]]:
        """A writer's commit (``Core.transact``): when every guard's bytes are as given,
        every write in order; the records of each class table written over relabelled
        (:meth:`_relabel`); then a sweep, or a pump of every provider. (applied, rings)."""
        buf = self.buf
        if any(bytes(buf[off : off + len(data)]) != data for off, data in guards):
            return False, set()
        was = {p: self._class_names(p) for p in self._providers()} if writes else {}
        for off, data in writes:
            buf[off : off + len(data)] = data
        for p, names in was.items():
            self._relabel(p, names)
        if sweep:
            return True, self.sweep(now)[1]
        return True, self.pump_all(now) if pump else set()

    def _class_names(self, p: int) -> list[bytes]:
        count = min(PROVIDER["class_count"].get(self.buf, provider_base(p)), layout.CLASS_COUNT)
        return [layout.CLASS["name"].get(self.buf, class_base(p, k)) for k in range(count)]

    def _relabel(self, p: int, was: list[bytes]) -> None:
        """Provider ``p``'s class table was written over: every running and waiting record
        keeps the class it asked for, found by its whole name in the new rows (whatever
        row it moved to); a record whose class is gone, or that counted in the default
        class, holds 0: the default class, resolved when read."""
        now = self._class_names(p)
        if now == was:
            return
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            v = HOLDER["cls"].get(self.buf, hb)
            if HOLDER["state"].get(self.buf, hb) not in (HOLDER_RUNNING, HOLDER_WAITING) or not v:
                continue
            to = now.index(was[v - 1]) + 1 if v - 1 < len(was) and was[v - 1] in now else 0
            if to != v:
                HOLDER["cls"].put(self.buf, to, hb)

    # --- granting -------------------------------------------------------------------
    def pump(self, p: int, now: float) -> set[int]:
        buf, base, rings = self.buf, provider_base(p), set[int]()
        if self._counters_damaged(base) and self.recount_provider(p):
            self.damage += 1
        running, waiting = self._get("running", base), self._get("waiting", base)
        if waiting == 0:
            return rings
        limit = limit_value(buf, p, now)
        if classes_in_force(buf, p):
            return self._pump_classed(p, running, waiting, limit, now)
        budget = token_limit_in_force(buf, p, now)
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
            if not self._tokens_allow(p, holder_base(p, h), budget):
                break  # strict order: the head waits for tokens, and those behind it too
            waiting -= 1
            if self._grant(base, holder_base(p, h), now, rings):
                running += 1
        self._put_counts(base, running, waiting)
        self._peak("peak_running", base, running)
        return rings

    def _pump_classed(self, p: int, running: int, waiting: int, limit: int, now: float) -> set[int]:
        """Grant, while some waiter may run, the one of the highest rank, oldest first."""
        buf, base, rings = self.buf, provider_base(p), set[int]()
        count = classes_in_force(buf, p)
        rules = class_rules(buf, p, count)
        run = self._class_running(p, count)
        budget = token_limit_in_force(buf, p, now)
        recounted = False
        while running < limit and waiting > 0:
            h, k, promoted_only, anyone = self._best_waiter(p, running, run, limit, rules, now)
            if h is None:
                if anyone or recounted:
                    break  # nobody who waits may run
                recounted = True  # somebody waits by the counters and no record does
                self.recount_provider(p)
                running, waiting = self._get("running", base), self._get("waiting", base)
                continue
            if not self._tokens_allow(p, holder_base(p, h), budget):
                break  # strict order: the best waiter waits for tokens, and those behind it
            waiting -= 1
            if not self._grant(base, holder_base(p, h), now, rings):
                continue
            running += 1
            run[k] += 1
            self._bump_class(p, k)
            if promoted_only:
                self._bump("promoted_total", base)
        self._put_counts(base, running, waiting)
        self._peak("peak_running", base, running)
        return rings

    def _tokens_allow(self, p: int, hb: int, budget: int) -> bool:
        """May the waiting record at ``hb`` be granted as far as tokens go? Its charge fits
        beside the tokens running, or its owner is dead (then the grant reclaims it)."""
        running = self._get("tokens_running", provider_base(p))
        charge = HOLDER["tokens"].get(self.buf, hb)
        return tokens_fit(running, charge, budget) or not self._holder_alive(hb)

    def _grant(self, base: int, hb: int, now: float, rings: set[int]) -> bool:
        """Grant the waiting record at ``hb``: RUNNING from now, its owner rung, its tokens
        counted; a dead one is reclaimed instead, never granted. True: granted."""
        if not self._holder_alive(hb):
            self._free_record(hb)
            self._bump("reclaimed_total", base)
            return False
        self._add_tokens(base, HOLDER["tokens"].get(self.buf, hb))
        HOLDER["since"].put(self.buf, now, hb)
        HOLDER["since_mono"].put(self.buf, now, hb)
        HOLDER["state"].put(self.buf, HOLDER_RUNNING, hb)
        rings.add(HOLDER["member"].get(self.buf, hb))
        self._bump("admitted_total", base)
        return True

    def _best_waiter(
        self, p: int, running: int, run: list[int], limit: int, rules: list[ClassRule], now: float
    ) -> tuple[int | None, int, bool, bool]:
        """(record, its class, only promotion lets it run, anybody waits) of the waiter
        that may run with the highest rank and the oldest ticket."""
        best: int | None = None
        best_key = (0, 0)
        best_class, best_promoted_only, anyone = 0, False, False
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if HOLDER["state"].get(self.buf, hb) != HOLDER_WAITING:
                continue
            anyone = True
            k, rank, promoted = self._rank(p, hb, rules, len(rules), now)
            if not may_run(k, running, run, limit, rules, promoted=promoted):
                continue
            key = (rank, HOLDER["ticket"].get(self.buf, hb))
            if best is None or key < best_key:
                best, best_key, best_class = h, key, k
                best_promoted_only = promoted and not may_run(
                    k, running, run, limit, rules, promoted=False
                )
        return best, best_class, best_promoted_only, anyone

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
        if self._count_older_members():  # a 3.0 handler registered by its own core
            rings |= self.pump_all(now)
        return reclaimed, rings

    def _count_older_members(self) -> bool:
        """Registered handlers that speak an older minor of this major: while one below 3.1
        is, the classes are suspended (DESIGN.md section 6b); while one below 3.2 is, the
        token budget (section 6c). True when either just was (more may run: pump). When
        the last handler below 3.2 left, every provider's tokens are recounted."""
        header = layout.HEADER
        before = header["older_members"].get(self.buf, 0)
        tokenless_before = header["tokenless_members"].get(self.buf, 0)
        older = tokenless = 0
        for m in range(layout.MEMBER_COUNT):
            mb = member_base(m)
            if (
                MEMBER["in_use"].get(self.buf, mb)
                and MEMBER["major"].get(self.buf, mb) <= layout.MAJOR
            ):
                minor = MEMBER["minor"].get(self.buf, mb)
                below = MEMBER["major"].get(self.buf, mb) < layout.MAJOR
                older += below or minor < 1
                tokenless += below or minor < 2
        header["older_members"].put(self.buf, older, 0)
        header["tokenless_members"].put(self.buf, tokenless, 0)
        if tokenless_before and not tokenless:
            self.repair()  # their cores left tokens_running behind: the records say
        return bool((before == 0 and older > 0) or (tokenless_before == 0 and tokenless > 0))

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
        WAITING, RUNNING is freed); True when something was wrong. ``tokens_running`` is
        rebuilt too, but a difference there is no damage: a core of an older minor frees
        records without knowing their tokens."""
        running = waiting = tokens = 0
        wrong = False
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            state = HOLDER["state"].get(self.buf, hb)
            if state not in (HOLDER_FREE, HOLDER_RUNNING, HOLDER_WAITING):
                self._free_record(hb)  # garbage: no writer wrote it
                state, wrong = HOLDER_FREE, True
            if state == HOLDER_RUNNING:
                running += 1
                tokens += HOLDER["tokens"].get(self.buf, hb)
            elif state == HOLDER_WAITING:
                waiting += 1
        base = provider_base(p)
        PROVIDER["tokens_running"].put(self.buf, min(tokens, 0xFFFFFFFF), base)
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
            if self._free_own_records(p, m, serial, (HOLDER_RUNNING, HOLDER_WAITING)):
                self.recount_provider(p)
                rings |= self.pump(p, now)
        return rings

    def _free_own_records(self, p: int, m: int, serial: int, states: tuple[int, ...]) -> int:
        """Free provider ``p``'s records of registration (m, serial) that are in one of
        ``states``; how many."""
        freed = 0
        for h in range(HOLDERS_PER_PROVIDER):
            hb = holder_base(p, h)
            if (
                HOLDER["state"].get(self.buf, hb) in states
                and HOLDER["member"].get(self.buf, hb) == m
                and HOLDER["member_serial"].get(self.buf, hb) == serial
            ):
                self._free_record(hb)
                freed += 1
        return freed

    def register(
        self,
        pid: int,
        start: float,
        label: bytes,
        now: float,
        taken: Callable[[int], bool],
        bell: int = 0,
        minor: int = layout.MINOR,
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
            MEMBER["minor"].put(buf, minor, mb)
            MEMBER["attached_at"].put(buf, now, mb)
            MEMBER["label"].put(buf, label[: layout.ID_BYTES], mb)
            MEMBER["bell"].put(buf, bell, mb)
            MEMBER["in_use"].put(buf, 1, mb)
            if self._count_older_members():
                rings |= self.pump_all(now)  # one FIFO from now on: grant what it allows
            return m, serial, rings
        if self._count_older_members():
            rings |= self.pump_all(now)
        return -1, 0, rings

    def unregister(self, m: int, serial: int, now: float) -> set[int]:
        rings = self.drop_member_records(m, serial, now)
        mb = member_base(m)
        if MEMBER["serial"].get(self.buf, mb) == serial:
            MEMBER["in_use"].put(self.buf, 0, mb)
            MEMBER["bell"].put(self.buf, 0, mb)
        self._count_older_members()
        return rings

    def ensure_provider(
        self,
        provider_id: str,
        fallback: int,
        source: int,
        flags: int,
        reason: bytes,
        classes: bytes = b"",
        default_class: int = 0,
    ) -> tuple[int, bool]:
        """The row of ``provider_id``, or a free one claimed with its class table
        (``classes``: rows of the writer's ``CLASS_ROW``) in the same step, in_use last:
        no arrival sees a claimed row without its classes. (-1, False): full."""
        spec = layout.CLASS["admitted_total"].offset  # a row's bytes a writer gives
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
            for k in range(layout.CLASS_COUNT):
                cb = class_base(p, k)
                self.buf[cb : cb + spec] = classes[k * spec : (k + 1) * spec].ljust(spec, b"\0")
            PROVIDER["default_class"].put(self.buf, default_class, base)
            PROVIDER["class_count"].put(self.buf, len(classes) // spec, base)
            PROVIDER["in_use"].put(self.buf, 1, base)
            return p, True
        return -1, False
