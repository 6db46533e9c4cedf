"""The share rules as one model under every fault at once: the pure table step
(``sidecar.shares.step``, which the Lua script is checked against), the gateway's rule
(``local_limit``) and the handlers' own rule (a published limit until its deadline,
then the segment's fallback, 0 in share mode), driven by hypothesis through histories
in which sidecars die, are SIGSTOPped past their lease (a call in flight), Redis stalls
(calls executed late, in any order) or restarts empty, Redis fails over to a replica
that lacks the last writes (asynchronous replication), a gateway is cut off from Redis,
its wall clock is off the farm's (no fresh capacity), a second instance starts
under a gateway's name, gateways run on different leases (a sidecar may come back with
its lease edited), and Redis's clock steps ahead by more than half a lease. At every
instant: the sum over gateways of what their handlers may run (the limit in force, or
more while more still run) never exceeds the capacity.

The one assumption about the world: a request ends within half a lease of its
admission, the margin the table keeps a lease beyond the gateway's deadline
(``held_for_ms``; docs/share.md says what a longer request at a vanished gateway
does)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sidecar.shares import (
    DUPLICATE,
    STALE,
    UNKNOWN,
    Held,
    Report,
    Table,
    held_for_ms,
    local_limit,
    step,
)

LEASE = 4_000  # ms
REQUEST_MAX = held_for_ms(LEASE) - LEASE  # a request ends within half a lease
CLIENT_TIMEOUT = 2_000  # redis-py gives up on an answer after this long (ms)


@dataclass
class Gateway:
    name: str
    token: str
    lease: int = LEASE  # ms; gateways may be configured with different leases
    sidecar: str = "up"  # "up", "stopped", "dead", "refused"
    partitioned: bool = False
    skewed: bool = False  # its wall clock is off the farm's: no fresh capacity
    published: tuple[int, int | None] = (0, None)  # limit, deadline (ms); None: fallback
    published_tokens: int = 0  # the token budget published with it (0: none)
    held: Held | None = None
    error: str = ""
    refused: str = ""
    running: list[tuple[int, int]] = field(default_factory=list)  # admission times, charges
    waiting: list[int] = field(default_factory=list)  # the waiters' charges, FIFO
    last_call: int = -(10**9)
    seq: int = 0
    in_flight: list[tuple[Report, int, Table | None, object]] = field(default_factory=list)


class ShareFarm(RuleBasedStateMachine):
    """One provider, capacity ``C``, a few gateways, one Redis; time in ms."""

    @initialize(
        capacity=st.integers(0, 12),
        floor=st.integers(0, 3),
        gateways=st.integers(1, 3),
        leases=st.lists(st.sampled_from([LEASE, 4 * LEASE]), min_size=3, max_size=3),
        pool=st.sampled_from([0, 300, 1000, 1536]),
        per_request=st.sampled_from([100, 512]),
    )
    def start(
        self,
        capacity: int,
        floor: int,
        gateways: int,
        leases: list[int],
        pool: int,
        per_request: int,
    ) -> None:
        self.capacity = capacity
        self.pool = pool  # the farm's running-token pool (0: none stated)
        # the most one request holds, which every kind that states a pool states too
        # (docs/share.md: a pool without it is not defended)
        self.per_request = min(per_request, pool)
        self.floor = floor
        self.now = 0
        self.table: Table | None = None
        self.server = "r0"  # the Redis that answers (its run_id)
        self.servers = 0
        self.history: list[Table | None] = []  # the last tables, newest last: a replica's copy
        self.redis_stalled = False
        self.redis_ahead = 0  # how far Redis's clock has stepped ahead of the gateways' (ms)
        self.queued: list[tuple[Gateway, Report, int]] = []  # calls a stalled Redis holds
        self.tokens = 0
        names = "abc"[:gateways]
        self.gws = [self._new(name, lease) for name, lease in zip(names, leases, strict=False)]
        # warm: every gateway registered and past the first table's rebuild
        self.advance_to(held_for_ms(LEASE) + LEASE // 4)

    def _new(self, name: str, lease: int) -> Gateway:
        self.tokens += 1
        return Gateway(name, f"t{self.tokens}", lease)

    def run(self, report: Report) -> object:
        """One call executed by the Redis that answers now."""
        self.table, grant = step(self.table, report, self.now + self.redis_ahead, self.server)
        self.history = [*self.history[-7:], self.table]
        return grant

    # --- the handlers' rule, and the gateway's --------------------------------------
    def in_force(self, g: Gateway) -> int:
        limit, deadline = g.published
        return limit if deadline is not None and self.now < deadline else 0

    def tokens_in_force(self, g: Gateway) -> int:
        _, deadline = g.published
        return g.published_tokens if deadline is not None and self.now < deadline else 0

    def pool_here(self, g: Gateway) -> int:
        if self.pool == 0:
            return 0
        return UNKNOWN if g.skewed else self.pool

    def publish(self, g: Gateway) -> None:
        capacity = UNKNOWN if g.skewed else self.capacity
        local = local_limit(
            g.held,
            capacity,
            self.now / 1000,
            g.error,
            refused=g.refused,
            tokens=self.pool_here(g),
            request_tokens=self.per_request,
        )
        deadline = None if local.deadline is None else round(local.deadline * 1000)
        g.published = (local.limit, deadline)
        g.published_tokens = local.tokens_limit

    def answer(self, g: Gateway, report: Report, asked: int, grant: object) -> None:
        """The sidecar receives a grant for the call it sent at ``asked``."""
        from sidecar.shares import Grant

        assert isinstance(grant, Grant)
        if grant.refused == DUPLICATE:
            g.refused = "refused: name held by another instance"
            g.sidecar = "refused"  # it publishes 0 and exits
        elif grant.refused != STALE:
            g.held = Held(
                grant.limit,
                grant.gateways,
                asked / 1000,
                g.lease / 1000,
                tokens=report.tokens,
                tokens_limit=grant.tokens_limit,
                tokens_of=grant.tokens,
            )
            g.error = ""
        self.publish(g)

    def report(self, g: Gateway) -> Report:
        """What ``g``'s sidecar sends on its next call."""
        tokens_running = sum(c for _, c in g.running)
        demand = tokens_running + sum(g.waiting)
        if g.running or g.waiting:
            demand = max(demand, self.per_request)
        return Report(
            g.name,
            UNKNOWN if g.skewed else self.capacity,
            max(self.in_force(g), len(g.running)),
            len(g.running) + len(g.waiting),
            self.floor,
            g.lease,
            g.token,
            g.seq,
            self.pool_here(g),
            max(self.tokens_in_force(g), tokens_running),
            demand,
            self.per_request,
        )

    def call(self, g: Gateway) -> None:
        if g.sidecar != "up":
            return
        g.last_call = self.now
        g.seq += 1
        report = self.report(g)
        if g.partitioned:
            g.error = "unreachable"
        elif self.redis_stalled:
            self.queued.append((g, report, self.now))
            g.error = "timed out"
        else:
            self.answer(g, report, self.now, self.run(report))
            return
        self.publish(g)

    # --- time ------------------------------------------------------------------------
    def check(self) -> None:
        total = sum(max(self.in_force(g), len(g.running)) for g in self.gws)
        assert total <= self.capacity, (self.now, total, self.capacity, self.gws, self.table)
        if self.pool:
            # the tokens running over every gateway, and what each may still admit
            tokens = sum(
                max(
                    self.tokens_in_force(g) if self.in_force(g) else 0, sum(c for _, c in g.running)
                )
                for g in self.gws
            )
            assert tokens <= self.pool, (self.now, tokens, self.pool, self.gws, self.table)

    def advance_to(self, target: int) -> None:
        """Renewals (every quarter of a lease, as the sidecar calls) and request ends, in
        time order, the invariant checked after each."""
        while True:
            renewals = [
                (g.last_call + g.lease // 4, 0, i)
                for i, g in enumerate(self.gws)
                if g.sidecar == "up"
            ]
            ends = [
                (min(g.running)[0] + REQUEST_MAX, 1, i) for i, g in enumerate(self.gws) if g.running
            ]
            due = min(renewals + ends, default=None)
            if due is None or due[0] > target:
                break
            self.now = max(self.now, due[0])
            g = self.gws[due[2]]
            if due[1] == 0:
                self.call(g)
            else:
                g.running.remove(min(g.running))
            self.check()
        self.now = target

    @rule(ms=st.integers(1, 3_000))
    def wait_a_while(self, ms: int) -> None:
        self.advance_to(self.now + ms)

    # --- requests --------------------------------------------------------------------
    def pick(self, i: int) -> Gateway:
        return self.gws[i % len(self.gws)]

    def charge(self, n: int) -> int:
        """A request's charge: within what one request may hold (a larger one the core
        refuses whatever the share)."""
        return 1 + n % max(1, self.per_request or self.pool or 1)

    def may_admit(self, g: Gateway, charge: int) -> bool:
        """The core's rule: a free slot under the limit in force, and the charge fits
        the token budget in force (none, nobody running, or the sum within it)."""
        budget = self.tokens_in_force(g)
        running = sum(c for _, c in g.running)
        fits = budget == 0 or running == 0 or running + charge <= budget
        return len(g.running) < self.in_force(g) and fits

    def too_large(self, g: Gateway, charge: int) -> bool:
        budget = self.tokens_in_force(g)
        return budget > 0 and charge > budget

    @rule(i=st.integers(0, 3), n=st.integers(0, 2000))
    def a_request_arrives(self, i: int, n: int) -> None:
        g = self.pick(i)
        charge = self.charge(n)
        if self.too_large(g, charge):
            return  # refused at once (the handlers answer 400)
        if not g.waiting and self.may_admit(g, charge):
            g.running.append((self.now, charge))
        else:
            g.waiting.append(charge)

    @rule(i=st.integers(0, 3), n=st.integers(1, 12), seed=st.integers(0, 2000))
    def a_burst_arrives(self, i: int, n: int, seed: int) -> None:
        g = self.pick(i)
        charges = (self.charge(seed * (k + 1)) for k in range(n))
        g.waiting += [c for c in charges if not self.too_large(g, c)]
        self.admit(g)

    @rule(i=st.integers(0, 3))
    def waiters_are_admitted(self, i: int) -> None:
        self.admit(self.pick(i))

    def admit(self, g: Gateway) -> None:
        """Waiters take the free slots under the limit in force, first come first; a
        head whose tokens do not fit holds back the others (strict order)."""
        while g.waiting and self.may_admit(g, g.waiting[0]):
            g.running.append((self.now, g.waiting.pop(0)))

    @rule(i=st.integers(0, 3))
    def a_waiter_is_admitted_or_gives_up(self, i: int) -> None:
        g = self.pick(i)
        if g.waiting:
            charge = g.waiting.pop(0)
            if self.may_admit(g, charge):
                g.running.append((self.now, charge))

    @rule(i=st.integers(0, 3))
    def a_request_finishes(self, i: int) -> None:
        g = self.pick(i)
        if g.running:
            g.running.remove(min(g.running))

    @rule(i=st.integers(0, 3))
    def the_sidecar_calls_now(self, i: int) -> None:
        self.call(self.pick(i))

    # --- faults ----------------------------------------------------------------------
    @rule(i=st.integers(0, 3))
    def a_sidecar_dies(self, i: int) -> None:
        g = self.pick(i)
        if g.sidecar in ("up", "stopped"):
            g.sidecar, g.in_flight = "dead", []

    @rule(i=st.integers(0, 3), lease=st.sampled_from([LEASE, 4 * LEASE]))
    def a_dead_sidecar_is_restarted(self, i: int, lease: int) -> None:
        g = self.pick(i)
        if g.sidecar == "dead":  # a new process: no grant yet, same instance token
            g.sidecar, g.held, g.error = "up", None, ""
            g.lease = lease  # perhaps with its config's lease edited meanwhile
            g.seq += 1000
            self.publish(g)

    @rule(i=st.integers(0, 3), call_in_flight=st.booleans())
    def a_sidecar_is_sigstopped(self, i: int, call_in_flight: bool) -> None:
        g = self.pick(i)
        if g.sidecar != "up":
            return
        if call_in_flight and not g.partitioned and not self.redis_stalled:
            # sent and executed just before the stop; the answer is read after SIGCONT
            g.seq += 1
            report = self.report(g)
            grant = self.run(report)
            g.in_flight.append((report, self.now, self.table, grant))
        g.sidecar = "stopped"

    @rule(i=st.integers(0, 3))
    def a_stopped_sidecar_continues(self, i: int) -> None:
        g = self.pick(i)
        if g.sidecar != "stopped":
            return
        g.sidecar = "up"
        for report, asked, _, grant in g.in_flight:
            self.answer(g, report, asked, grant)
        g.in_flight = []
        self.publish(g)  # the lapse is seen at once

    @rule()
    def redis_stalls(self) -> None:
        self.redis_stalled = True

    @rule(reverse=st.booleans())
    def redis_resumes(self, reverse: bool) -> None:
        """The calls it held run now, in either order (a timed-out client's call on a
        dropped connection may run after a newer one); an answer reaches a sidecar that
        is still waiting for it."""
        if not self.redis_stalled:
            return
        self.redis_stalled = False
        queued, self.queued = self.queued, []
        for g, report, asked in reversed(queued) if reverse else queued:
            grant = self.run(report)
            if g.sidecar == "up" and self.now - asked <= CLIENT_TIMEOUT:
                self.answer(g, report, asked, grant)

    @rule(ms=st.integers(LEASE // 2 + 1, 4 * LEASE))
    def redis_clock_steps_ahead(self, ms: int) -> None:
        """More than half the shortest lease (a smaller step eats into the margin a
        request admitted just before its gateway's deadline runs in: docs/share.md)."""
        self.redis_ahead += ms

    @rule()
    def redis_restarts_empty(self) -> None:
        self.table = None
        self.queued = []
        self.servers += 1
        self.server = f"r{self.servers}"
        self.history = []

    @rule(lost=st.integers(0, 7), answered=st.booleans())
    def redis_fails_over_to_a_replica_that_lost_writes(self, lost: int, answered: bool) -> None:
        """Sentinel promotes a replica whose copy lacks the last ``lost`` writes
        (replication is asynchronous). Calls the old master held run there first, and
        their answers reach a sidecar still waiting (``answered``: the old master was
        paused, not killed); after that the old master is a replica, its table gone."""
        queued, self.queued = self.queued, []
        self.redis_stalled = False
        copy = self.history[-1 - lost] if len(self.history) > lost else None
        for g, report, asked in queued:
            grant = self.run(report)
            if answered and g.sidecar == "up" and self.now - asked <= CLIENT_TIMEOUT:
                self.answer(g, report, asked, grant)
        self.servers += 1
        self.server = f"r{self.servers}"
        self.table = copy
        self.history = []

    @rule(i=st.integers(0, 3))
    def a_gateway_is_cut_off_from_redis(self, i: int) -> None:
        self.pick(i).partitioned = True

    @rule(i=st.integers(0, 3))
    def a_partition_heals(self, i: int) -> None:
        self.pick(i).partitioned = False

    @rule(i=st.integers(0, 3), skewed=st.booleans())
    def a_wall_clock_is_an_hour_off(self, i: int, skewed: bool) -> None:
        self.pick(i).skewed = skewed

    @rule(i=st.integers(0, 3))
    def a_second_instance_starts_under_a_gateways_name(self, i: int) -> None:
        if len(self.gws) < 4:
            twin = self._new(self.pick(i).name, self.pick(i).lease)
            self.gws.append(twin)
            self.publish(twin)

    @invariant()
    def the_farm_never_runs_over_capacity(self) -> None:
        self.check()


ShareFarm.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_share_model_holds_the_capacity_in_every_fault = ShareFarm.TestCase
