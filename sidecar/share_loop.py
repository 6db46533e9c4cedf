"""Share mode's loop in the sidecar: keep this gateway's lease per provider in Redis and
publish the share it holds as the provider's limit, source ``share`` (docs/share.md).

What a share *is* comes from :mod:`sidecar.shares` (pure); the one Redis call from
:mod:`sidecar.share`. This module only does the timing: when a call is due, what it
reports (read from the segment after the last publication), and what the answer
changes in the daemon's decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from capacity_contract import MAX_FUTURE_S
from shm_layout import layout, platform, rows, writer
from sidecar.config import CapacityShare, sentinel_addresses, share_target_for_logs
from sidecar.limits import DISCOVERED, LEGACY_DRAIN, SHARE, LimitDecision
from sidecar.share import instance_token
from sidecar.shares import DEGRADED, DUPLICATE, NO_POOL, UNKNOWN, Held, Report, local_limit

if TYPE_CHECKING:
    from shm_layout.segment import Segment
    from sidecar.metrics import SidecarMetrics
    from sidecar.provider_state import ProviderState
    from sidecar.share import ShareClient

log = logging.getLogger("gateway_capacity.sidecar")

SHARE_POLL_S = 0.05  # how often share mode looks at running and waiting
SHARE_MIN_CALL_S = 0.1  # at most this often a call per provider when demand changes
SHARE_RENEWALS = 4  # calls per lease at least: half a lease of silence means an outage
SHARE_WAITING_CALL_S = 0.25  # how often a provider with waiting requests asks again


class ShareHost(Protocol):
    """What the loop needs of the daemon that runs it (``sidecar.daemon.Sidecar``)."""

    segment_name: str
    seg: Segment
    epoch: int
    retired: bool
    exit_code: int
    stop: asyncio.Event
    metrics: SidecarMetrics
    providers: dict[str, ProviderState]

    def redecide(self, state: ProviderState, now: float) -> LimitDecision: ...
    def redecide_all(self) -> None: ...
    def publish(self) -> None: ...
    def retire(self, exc: writer.Superseded) -> None: ...
    def log_unexpected(self, where: str) -> None: ...


@dataclass
class ProviderShare:
    """One provider's lease as this gateway last saw it."""

    held: Held | None = None  # the last grant
    error: str = ""  # why the last call failed ("" when it answered)
    asked: tuple[int, ...] = ()  # what the last call reported
    asked_mono: float = -1e18
    # what this gateway reports: the discovered capacity, or UNKNOWN without a fresh one
    capacity: int = UNKNOWN
    # the farm's token pool: as stated (NO_POOL: none), UNKNOWN without a fresh answer
    # once one was stated; and the most one request may hold, as last stated
    tokens: int = NO_POOL
    request_tokens: int = 0


def token_load(buf: rows.Buffer, p: int, now: float) -> tuple[int, int]:
    """Provider ``p``'s tokens as share mode reports them, read without the lock: what
    it holds (``max(token limit in force, tokens running)``) and its demand (the charges
    running and waiting)."""
    base = rows.provider_base(p)
    running = int(layout.PROVIDER["tokens_running"].get(buf, base))
    waiting = 0
    for h in range(layout.HOLDERS_PER_PROVIDER):
        hb = rows.holder_base(p, h)
        if layout.HOLDER["state"].get(buf, hb) == layout.HOLDER_WAITING:
            waiting += int(layout.HOLDER["tokens"].get(buf, hb))
    return max(rows.token_budget(buf, p, now).limit, running), running + waiting


class ShareLoop:
    def __init__(self, sidecar: ShareHost, share: CapacityShare) -> None:
        self.sidecar = sidecar
        self.config = share  # read once: a change needs a restart
        self.client: ShareClient | None = None
        self.providers: dict[str, ProviderShare] = {}
        self._down_since: float | None = None  # monotonic; None: Redis answers
        self.token = instance_token(sidecar.segment_name)
        self._seq = 0
        self.refused = ""  # why Redis refused this instance its gateway name, for good
        self.clock_offset_s: float | None = None  # this host's wall clock minus Redis's

    def of(self, provider_id: str) -> ProviderShare:
        return self.providers.setdefault(provider_id, ProviderShare())

    async def run(self) -> None:
        """Keep a lease per provider whose capacity is discovered: a call when what this
        gateway reports changes (at most every ``SHARE_MIN_CALL_S``), while requests wait
        (every ``SHARE_WAITING_CALL_S``) and at least ``SHARE_RENEWALS`` times a lease;
        each answer is published at once."""
        share = self.config
        from sidecar.credential import CredentialError, read_credential
        from sidecar.share import ShareClient

        secrets: list[str | None] = []
        for spec in (
            share.credential_file,
            share.sentinel.credential_file if share.sentinel is not None else None,
        ):
            try:
                secrets.append(None if spec is None else read_credential(spec).reveal())
            except CredentialError as exc:
                log.error("capacityShare: %s; share mode holds no share", exc)
                self._failed(f"credential: {exc}")
                return
        try:
            password, sentinel_password = secrets
            self.client = ShareClient(
                share.redis,
                password,
                sentinel=None
                if share.sentinel is None
                else (share.sentinel.master, sentinel_addresses(share.sentinel)),
                sentinel_password=sentinel_password,
                owner=share.listener_owner,
            )
        except Exception as exc:  # check_share builds the same client: only a redis-py surprise
            log.error(
                "capacityShare: redis-py refused the URL (%s); share mode holds no share", exc
            )
            self._failed(f"redis-py refused the URL: {type(exc).__name__}")
            return
        log.info(
            "capacityShare: gateway %s (instance %s) shares each discovered capacity through "
            "%s (lease %gs, floor %d)",
            share.gateway,
            self.token,
            share_target_for_logs(share),
            share.lease,
            share.floor,
        )
        while not self.sidecar.stop.is_set():
            try:
                await self.turn()
            except Exception:
                self.sidecar.log_unexpected("share mode")
            await asyncio.sleep(SHARE_POLL_S)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def turn(self) -> None:
        sc = self.sidecar
        share = self.config
        if self.client is None or sc.retired:
            return
        changed = False
        for provider_id, state in list(sc.providers.items()):
            d = state.decision
            if d is None or d.source != SHARE or self.refused:
                continue
            mine = self.of(provider_id)
            capacity = mine.capacity
            p = rows.find_provider(sc.seg.buf, provider_id)
            if p is None:
                continue
            now_mono = platform.deadline_now()
            load = rows.provider_load(sc.seg.buf, p, now_mono)
            running, waiting, in_force = load.running, load.waiting, load.limit
            held = max(in_force, running)
            tokens_held, tokens_demand = token_load(sc.seg.buf, p, now_mono)
            if running + waiting:  # at least one whole request while any runs or waits
                tokens_demand = max(tokens_demand, mine.request_tokens)
            asked = (capacity, held, running + waiting, mine.tokens, tokens_held, tokens_demand)
            mono = time.monotonic()
            since = mono - mine.asked_mono
            # due: a quarter of a lease passed; what it reports changed; or requests wait
            # (a share another gateway gives up is granted only on asking again)
            due = (
                since >= share.lease / SHARE_RENEWALS
                or (asked != mine.asked and since >= SHARE_MIN_CALL_S)
                or (waiting > 0 and since >= SHARE_WAITING_CALL_S)
            )
            if not due:
                continue
            asked_mono = platform.deadline_now()
            report = Report(
                share.gateway,
                capacity,
                held,
                running + waiting,
                share.floor,
                int(share.lease * 1000),
                self.token,
                self._next_seq(asked_mono),
                mine.tokens,
                tokens_held,
                tokens_demand,
                mine.request_tokens,
            )
            from sidecar.share import ShareUnavailable

            # a sidecar fenced by a newer one on this segment (same gateway name and
            # token) must not call: its report, read before the newer one published a
            # larger grant, would lower the reservation under that grant. After this
            # check the newer one's calls carry higher sequence numbers, so a call of
            # this one that Redis runs later is refused as stale.
            current = layout.HEADER["writer_epoch"].get(sc.seg.buf)
            if current != sc.epoch:
                sc.retire(writer.Superseded(sc.epoch, current))
                return
            mine.asked, mine.asked_mono = asked, mono
            try:
                answer = await self.client.call(provider_id, report)
            except ShareUnavailable as exc:
                self._failed(str(exc))
                mine.error = str(exc)
                sc.metrics.share_call(provider_id, "unavailable")
            else:
                self._recovered()
                self._clock(answer.server_ms, time.time())
                g = answer.grant
                sc.metrics.share_call(provider_id, g.refused or "ok")
                if g.refused == DUPLICATE:
                    self._refuse()
                    return
                if not g.refused:  # a STALE answer changed nothing: a newer one holds
                    mine.error = ""
                    mine.held = Held(
                        g.limit,
                        g.gateways,
                        asked_mono,
                        share.lease,
                        g.rebuild_left_ms / 1000,
                        report.tokens,
                        g.tokens_limit,
                        g.tokens,
                    )
            if sc.providers.get(provider_id) is state:
                before = state.decision
                after = sc.redecide(state, time.time())
                changed = (
                    changed
                    or before is None
                    or (before.effective_limit, before.reason, before.expires_mono)
                    != (after.effective_limit, after.reason, after.expires_mono)
                )
        # a lease that lapsed while no call was due (Redis slow) is noticed here too
        for state in sc.providers.values():
            d = state.decision
            if (
                d is not None
                and d.source == SHARE
                and d.expires_mono is not None
                and d.expires_mono <= platform.deadline_now() + SHARE_POLL_S
            ):
                sc.redecide(state, time.time())
                changed = True
        if changed:
            sc.publish()

    def shared(
        self, state: ProviderState, decision: LimitDecision, now: float, mono: float
    ) -> LimitDecision:
        """In share mode every provider with discovery enforces its share of the farm
        (``shares.local_limit``), source ``share``: of the discovered capacity, or, with
        no fresh answer (a failed probe, a wall clock off the farm's), of an unknown one,
        at most the floor. Never the static fallback: the others do not leave room for
        it. The share's deadline is its lease's, seen from here: a sidecar that dies
        leaves no share in force past it, and the handlers then fall back to 0."""
        if not state.rules.discovery_active or decision.source == LEGACY_DRAIN:
            return decision
        mine = self.of(state.rules.provider_id)
        known = decision.source == DISCOVERED and decision.expires_mono is not None
        mine.capacity = decision.effective_limit if known else UNKNOWN
        if known:
            mine.tokens = decision.token_limit or NO_POOL
            mine.request_tokens = decision.request_token_limit
        elif mine.tokens != NO_POOL:  # a pool once stated is unknown now, not gone
            mine.tokens = UNKNOWN
        local = local_limit(
            mine.held,
            mine.capacity,
            mono,
            mine.error,
            refused=self.refused,
            tokens=mine.tokens,
            request_tokens=mine.request_tokens,
        )
        if known:
            reason = f"{local.reason}; capacity {decision.reason}"
        else:  # at most the floor, for want of a capacity: degraded, --check fails
            reason = (
                f"{DEGRADED}capacity unknown here{self._clock_note()}: "
                f"{local.reason.removeprefix(DEGRADED)}; {decision.reason}"
            )
        expires_mono = local.deadline
        if expires_mono is not None and known and decision.expires_mono is not None:
            expires_mono = min(expires_mono, decision.expires_mono)
        return dataclasses.replace(
            decision,
            effective_limit=local.limit,
            token_limit=local.tokens_limit,
            source=SHARE,
            reason=reason,
            expires_at=None if expires_mono is None else now + (expires_mono - mono),
            expires_mono=expires_mono,
        )

    def _next_seq(self, mono: float) -> int:
        """Increasing across restarts of this instance on one boot: the deadline clock in
        microseconds (and at least one more than the last)."""
        self._seq = max(self._seq + 1, int(mono * 1_000_000))
        return self._seq

    def _clock(self, server_ms: int, local_s: float) -> None:
        """Compare this host's wall clock with Redis's: snapshots are judged by the
        former (R-K4), leases by the latter only."""
        offset = local_s - server_ms / 1000
        off = abs(offset) > MAX_FUTURE_S
        was = self.clock_offset_s is not None and abs(self.clock_offset_s) > MAX_FUTURE_S
        self.clock_offset_s = offset
        if off and not was:
            log.warning(
                "capacityShare: this host's wall clock is %+.0f s off Redis's: the farm's "
                "snapshots are judged by it, so discovery may fail here; this gateway then "
                "holds at most the floor. Fix the host's time (NTP)",
                offset,
            )
        elif was and not off:
            log.info("capacityShare: this host's wall clock agrees with Redis's again")

    def _clock_note(self) -> str:
        offset = self.clock_offset_s
        if offset is None or abs(offset) <= MAX_FUTURE_S:
            return ""
        return f" (this host's wall clock is {offset:+.0f} s off Redis's)"

    def _refuse(self) -> None:
        """Another instance holds this gateway's name: hold 0, say so, and exit 2 (a
        configuration to fix, which systemd does not restart)."""
        sc = self.sidecar
        self.refused = (
            f"refused: gateway name {self.config.gateway!r} is held in Redis by another "
            f"instance (this one is {self.token}); give each gateway its own "
            "capacityShare.gateway"
        )
        log.error("capacityShare: %s; this sidecar holds no share and exits (2)", self.refused)
        sc.metrics.share_refused()
        sc.redecide_all()
        sc.publish()
        sc.exit_code = 2
        sc.stop.set()

    def _failed(self, why: str) -> None:
        self.sidecar.metrics.share_reachable(False)
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "capacityShare: %s: keeping each share until its lease ends (%gs), then 0; "
                "availability --check fails until Redis answers",
                why,
                self.config.lease,
            )

    def _recovered(self) -> None:
        self.sidecar.metrics.share_reachable(True)
        if self._down_since is not None:
            log.info(
                "capacityShare: Redis answers again after %.1fs: shares follow demand",
                time.monotonic() - self._down_since,
            )
            self._down_since = None
