"""The sidecar: probe, decide, publish; reap; follow the config; step aside when fenced.

This module only does I/O and timing. What the limit *is* comes from
``sidecar.limits.decide`` (pure), what a probe found from ``sidecar.probe``,
and every byte written to the segment goes through ``shm_layout.writer``,
which refuses a superseded writer under the segment lock (R-G4).

Tasks, all on one asyncio loop:

* one probe loop per provider with discovery, so a slow provider never
  delays another (R-P8); each probes at start, every ``refresh_s`` and at
  once when the config changes (R-P9). The loops keep to one common grid of
  ``refresh_s``, so a refresh's answers arrive together, and the publications
  they ask for within ``PUBLISH_COALESCE_S`` are one transaction that writes
  only what changed (one publish per refresh, not one per provider, each
  rewriting every provider);
* in share mode (``capacityShare``, docs/share.md), the lease loop of
  ``sidecar.share_loop``, which publishes this gateway's share as the limit;
* housekeeping every ``TICK_S``: heartbeat and reaping of dead holders
  (R-A5), legacy processes (R-G3; which ones: ``sidecar.legacy``), the parent
  (``--parent-pid``), the config file (R-C3, R-C4) and the systemd watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shm_layout import layout, platform, writer
from shm_layout.errors import GatewayCapacityError
from shm_layout.layout import Source
from shm_layout.liveness import ParentWatch, my_identity
from shm_layout.names import resolve_segment_name
from shm_layout.owners import OwnerError, OwnerPolicy
from shm_layout.reasons import ReasonsWriter, texts_of
from shm_layout.segment import ForeignSegment, Segment
from shm_layout.view import ReplicaView, parse_view, snapshot_bytes
from sidecar import sdnotify
from sidecar.addresses import is_loopback, parse_host_port, parse_ip
from sidecar.config import (
    CLASSES_REFUSED,
    ConfigError,
    GatewayConfig,
    classes_status,
    load_config,
    parse_base_url,
)
from sidecar.legacy import (
    LegacyDrain,
    forbidden_legacy_pids,
    legacy_label,
    parse_legacy,
    proc_hides_other_users,
)
from sidecar.limits import (
    DISCOVERED,
    LEGACY_DRAIN,
    SHARE,
    LimitDecision,
    ProviderRules,
    decide,
    fallback_for,
    inherited_from_view,
    keep_inherited,
    rules_from_config,
)
from sidecar.metrics import SidecarMetrics, probe_reasons
from sidecar.provider_state import ProviderState
from sidecar.share_loop import ShareLoop
from sidecar.startup import StartupError

if TYPE_CHECKING:
    from prometheus_client.exposition import ThreadingWSGIServer

    from sidecar.probe import ProbeClients

log = logging.getLogger("gateway_capacity.sidecar")

_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
TICK_S = 0.5  # housekeeping period: reap at least once a second (R-A5)
CONFIG_POLL_S = 1.0
DRAIN_REPUBLISH_S = 5.0
SEGMENT_CHECK_S = 2.0
# answers that arrive within this long of each other share one publication; short
# enough that no provider's news waits on another's probe (R-P8)
PUBLISH_COALESCE_S = 0.05
AWAIT_LEGACY_MAX_S = 1800.0


@dataclass
class Options:
    config_path: str
    refresh_s: float = 15.0
    segment: str | None = None
    await_legacy: Sequence[str] = ()
    await_legacy_grace_s: float = 10.0
    await_legacy_max_s: float = AWAIT_LEGACY_MAX_S
    parent_pid: int | None = None
    group_shared: bool = False
    owner: str | None = None  # another user the segment may belong to (R-G6)
    group: str | None = None
    tailscale_socket: str | None = None
    metrics_listen: str | None = None


@dataclass
class _Output:
    """What goes out besides the limits, and what has gone out: the reason texts beside
    the segment, the publication cache (only what changed is written), whether a
    publication is due, the warnings logged (each once per run, R-P9) and the ``STATUS=``
    line systemd last took."""

    reasons: ReasonsWriter
    cache: writer.PublishCache = field(default_factory=writer.PublishCache)
    pending: bool = False  # a publication is due within PUBLISH_COALESCE_S
    warned: set[str] = field(default_factory=set)
    status_sent: str = ""
    ready: bool = False  # STATUS= goes out only after READY=1

    def first_time(self, warning: str) -> bool:
        """True the first time ``warning`` comes up in this run."""
        if warning in self.warned:
            return False
        self.warned.add(warning)
        return True


class Sidecar:
    def __init__(self, options: Options) -> None:
        # All that may refuse the start comes before the segment and its writer epoch: a
        # sidecar that cannot start must not fence the running one (R-G4), then leave none.
        self.opts = options
        self.config, self.config_stamp = _first_config(options.config_path)
        self.config_status = classes_status(self.config)
        self.legacy = _legacy_drain(options)
        self.parent = _parent_watch(options.parent_pid)
        self.segment_name = resolve_segment_name(options.segment, options.config_path)
        self.metrics = SidecarMetrics()  # recorded always, served with --metrics-listen
        self._metrics_server = _serve_metrics(
            options.metrics_listen, self.segment_name, self.metrics
        )
        self.seg = Segment.open(
            self.segment_name,
            create=True,
            group_shared=options.group_shared,
            owner=options.owner,
            group=options.group,
        )
        self.pid, self.start = my_identity()
        self.providers: dict[str, ProviderState] = {}
        self.inherited: dict[str, LimitDecision] = {}
        self.generation = 0
        self.epoch = 0
        self.retired = False
        self.stop = asyncio.Event()
        self.exit_code = 0
        self.clients: ProbeClients | None = None
        self._retained: asyncio.Task[None] | None = None
        self._watchdog = sdnotify.Watchdog.from_env()
        self._grid_origin = time.monotonic()  # probe loops start on multiples of refresh_s
        self.out = _Output(ReasonsWriter(self.segment_name, self.seg.mode))
        # read once: a reload that adds, drops or changes capacityShare needs a restart
        share = self.config.share
        self.sharing = ShareLoop(self, share) if share is not None else None

    # --- life cycle ---------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # systemctl reload (ExecReload= sends SIGHUP): re-read the config now. Without
        # a handler SIGHUP would kill the sidecar, which systemd counts as a clean exit.
        loop.add_signal_handler(signal.SIGHUP, self._on_reload)
        before = self._running_sidecar()
        self.epoch = writer.take_epoch(
            self.seg,
            self.pid,
            self.start,
            time.time(),
            self.opts.refresh_s,
            os.path.abspath(self.opts.config_path),
        )
        self.generation = self._header("config_generation") + 1
        self.inherited = self._inherit_limits(time.time())
        log.info(
            "sidecar started: segment %s, writer epoch %d, refresh %gs, config %s",
            self.segment_name,
            self.epoch,
            self.opts.refresh_s,
            self.opts.config_path,
        )
        if before is not None:  # say on this side too whom the new epoch fenced (R-G4)
            log.warning(
                "fenced the running sidecar pid %d (writer epoch %d): it stops writing and exits 0",
                *before,
            )
        for legacy in self.legacy.processes:
            log.info(
                "waiting for legacy process %s to exit", legacy_label(legacy.label, legacy.pid)
            )
        # Before READY=1: httpx and anyio are loaded here (and the certifi bundle by
        # _apply_config when an https provider needs it), not inside the first probe's
        # 3 s deadline (a loaded host could miss it, R-P5).
        from sidecar.probe import ProbeClients

        self.clients = ProbeClients()
        self._apply_config(self.config)
        self.publish()
        sdnotify.ready()
        self.out.ready = True
        self._send_status()
        housekeeping = asyncio.create_task(self._housekeeping())
        sharing = asyncio.create_task(self.sharing.run()) if self.sharing else None
        await self.stop.wait()
        housekeeping.cancel()
        if sharing is not None:
            sharing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sharing
        if self.sharing is not None:
            with contextlib.suppress(Exception):
                await self.sharing.aclose()
        for state in self.providers.values():
            if state.task is not None:
                state.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await housekeeping
        for state in self.providers.values():
            if state.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await state.task
        if self.clients is not None:
            await self.clients.aclose()
        if not self.retired and not self.seg.core.lost:  # lost: nothing of it is left to say it in
            writer.set_state(self.seg, self.epoch, layout.SIDECAR_STOPPED)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.seg.close()
        return self.exit_code

    def _running_sidecar(self) -> tuple[int, int] | None:
        """Pid and writer epoch of a live sidecar that holds the segment now, if any."""
        data, _ = snapshot_bytes(self.seg.buf)
        seen = parse_view(self.segment_name, data, now=time.time()).sidecar
        if seen is None or not seen.alive or seen.state != "running" or seen.pid == self.pid:
            return None
        return seen.pid, seen.writer_epoch

    def _on_signal(self, sig: int) -> None:
        log.info(
            "received %s: stopping; the segment stays for the handlers", signal.Signals(sig).name
        )
        sdnotify.stopping()
        self.stop.set()

    def _on_reload(self) -> None:
        log.info("received SIGHUP: re-reading the config %s", self.opts.config_path)
        self.config_stamp = (-1, -1, -1, -1)  # re-read even if the file looks unchanged
        generation = self.generation
        try:
            self._check_config()
        except Exception:  # a reload must never take the sidecar down
            self.log_unexpected("reload")
        if self.generation == generation and self.config_status == classes_status(self.config):
            log.info("config unchanged")

    def _segment_gone(self) -> bool:
        """The segment was removed, replaced or truncated under us (R-A15): exit 1, so that
        a restart attaches to what the name leads to now. Returns False (stop)."""
        if self.seg.core.lost:
            log.error(
                "segment %s was truncated under this sidecar (by hand, or by a member of its "
                "group, who may write it); exiting so that a restart attaches to what its "
                "name leads to ('gateway-capacity inspect --check' names it)",
                self.segment_name,
            )
        else:
            log.error(
                "segment %s was removed or replaced under this sidecar (inspect "
                "--unlink --force?); exiting so that a restart attaches to the "
                "current one",
                self.segment_name,
            )
        self.exit_code = 1
        self.stop.set()
        return False

    def retire(self, exc: writer.Superseded) -> None:
        if not self.retired:
            self.retired = True
            log.warning(
                "superseded: writer epoch %d was taken over by epoch %d; "
                "stopping without writing anything more",
                exc.mine,
                exc.current,
            )
            self.stop.set()

    def _header(self, name: str) -> int:
        value: int = layout.HEADER[name].get(self.seg.buf)
        return value

    # --- config ---------------------------------------------------------------------------
    def _apply_config(self, config: GatewayConfig) -> None:
        """Adopt ``config``: new rules at once (R-C4), probe loops for discovery providers."""
        self.config = config
        for reason in config.skipped:
            log.warning("config: skipped a provider entry: %s", reason)
        for unknown in config.unknown_keys:
            log.warning("config: %s", unknown)
        for provider_id, why in config.class_problems.items():
            log.error(
                "config: provider %s: %s, it admits as one queue until they are fixed: %s",
                provider_id,
                CLASSES_REFUSED,
                "; ".join(why),
            )
        wanted = {r.provider_id: r for r in rules_from_config(config)}
        for provider_id in list(self.providers):
            if provider_id not in wanted:
                gone = self.providers.pop(provider_id)
                if gone.task is not None:
                    gone.task.cancel()
                self.metrics.forget(provider_id)
                log.info("provider %s: removed from the config", provider_id)
        for provider_id, rules in wanted.items():
            provider = config.provider(provider_id)
            assert provider is not None
            state = self.providers.get(provider_id)
            if state is None:
                state = self.providers[provider_id] = ProviderState(rules, provider)
            else:
                if state.rules.discovery_active and not rules.discovery_active:
                    state.probe = None  # R-C4: static at once, nothing stale kept
                if provider != state.config:  # by value: an unchanged entry keeps its probe
                    state.config = provider
                state.rules = rules
            self.redecide(state, time.time())
            self.metrics.not_probed(provider_id, rules.refused_reason, self.opts.refresh_s)
            if rules.discovery_active:
                if (
                    self.clients is not None
                    and provider.base_url is not None
                    and provider.base_url.lower().startswith("https:")
                ):
                    self.clients.tls_context()
                if state.task is None or state.task.done():
                    state.task = asyncio.create_task(self._probe_loop(provider_id))
                else:
                    state.wake.set()  # probe again now with the new entry (R-P9)
            elif state.task is not None:
                state.task.cancel()
                state.task = None
        if self.clients is not None:  # hosts no longer probed keep no client, no socket
            endpoints = []
            for provider in config.providers:
                with contextlib.suppress(ValueError):
                    if provider.base_url and self.providers[provider.id].rules.discovery_active:
                        endpoints.append(parse_base_url(provider.base_url))
            self._retained = asyncio.get_running_loop().create_task(self.clients.retain(endpoints))

    def _check_config(self) -> None:
        stamp = _stamp(self.opts.config_path)
        if stamp == self.config_stamp:
            return
        self.config_stamp = stamp
        try:
            config = load_config(self.opts.config_path)
        except ConfigError as exc:
            # The segment keeps REASON_BYTES of status: verdict first and without the
            # (long, already known) path, so the why is not cut off (R-C3).
            why = str(exc).replace(f" {self.opts.config_path}", "")
            status = f"broken edit ignored, last good config kept: {why}"
            if status != self.config_status:
                log.error("config %s: %s", self.opts.config_path, status)
                self.config_status = status
                self.publish()
            return
        if config == self.config and self.config_status == classes_status(config):
            return  # touched or rewritten with the same content: nothing to redo (R-P9)
        log.info("config: change picked up")
        if config.share != (self.sharing.config if self.sharing is not None else None):
            log.warning(
                "config: capacityShare changed; it is read at start only: restart the sidecar "
                "to apply it (the running one keeps the old setting)"
            )
        self.generation += 1
        self.config_status = classes_status(config)
        self._apply_config(config)
        self.publish()

    # --- probing and publishing -------------------------------------------------------------
    async def _probe_loop(self, provider_id: str) -> None:
        from sidecar.probe import probe_provider  # httpx only in the daemon

        assert self.clients is not None
        while not self.stop.is_set():
            state = self.providers.get(provider_id)
            if state is None or not state.rules.discovery_active:
                return
            state.wake.clear()
            asked = state.config
            began = time.monotonic()
            try:
                probe = await probe_provider(
                    asked, tailscale_socket=self.opts.tailscale_socket, clients=self.clients
                )
            except Exception:  # probe_provider never raises for a provider's fault; be sure
                self.log_unexpected(f"probe of {provider_id}")
                await asyncio.sleep(self.opts.refresh_s)
                continue
            if self.providers.get(provider_id) is not state or not state.rules.discovery_active:
                return  # removed or turned off while probing: that answer is not wanted
            self.metrics.record_probe(
                provider_id,
                probe_reasons(probe.refused, (r.reason for r in probe.replicas)),
                time.monotonic() - began,
            )
            if state.config is not asked:
                continue  # the entry changed while we probed (a new baseUrl?): ask again
            state.probe = probe
            self.redecide(state, time.time())
            self._publish_soon()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.wake.wait(), self._until_next_refresh())

    def _until_next_refresh(self) -> float:
        """Seconds to the next point of the common refresh grid (R-P9): every provider
        probes on it, so one refresh's answers can share one publication."""
        period = self.opts.refresh_s
        return period - (time.monotonic() - self._grid_origin) % period

    def _publish_soon(self) -> None:
        """Publish within ``PUBLISH_COALESCE_S``, together with whatever else arrives."""
        if self.out.pending:
            return
        self.out.pending = True
        asyncio.get_running_loop().call_later(PUBLISH_COALESCE_S, self._publish_now)

    def _publish_now(self) -> None:
        self.out.pending = False
        try:
            self.publish()
        except Exception:  # a callback must not die silently
            self.log_unexpected("publication")

    def _decide(self, state: ProviderState, now: float) -> LimitDecision:
        """The pure rules decide in the wall clock's frame at ``now``; deadlines already
        fixed on the deadline clock are seen through that frame, and a new one is fixed
        now (R-L7): so a step of the wall clock never moves a limit's expiry."""
        mono = platform.deadline_now()
        if state.last_discovered is not None:
            state.last_discovered = _seen_at(state.last_discovered, now, mono)
        decision = _anchored(self._decide_once(state, now), now, mono)
        if decision.source == DISCOVERED and decision.discovered is not None:
            # R-L6's base is the last *discovered* limit while unexpired, not the last
            # decision: one failed refresh in between must not reset it to the fallback.
            state.last_discovered = decision
        if self.sharing is None:
            return decision
        return self.sharing.shared(state, decision, now, mono)

    def _decide_once(self, state: ProviderState, now: float) -> LimitDecision:
        """Section 5's decision; until the first probe, a limit inherited from the
        previous sidecar stays in force (``limits.keep_inherited``)."""
        decision = decide(
            state.rules, state.probe, state.last_discovered, now, legacy_draining=self._draining()
        )
        provider_id = state.rules.provider_id
        if state.probe is not None or not state.rules.discovery_active:
            self.inherited.pop(provider_id, None)
            return decision
        kept = self.inherited.get(provider_id)
        if kept is None:
            return decision
        kept = _seen_at(kept, now, platform.deadline_now())
        return keep_inherited(decision, kept, state.rules, now) or decision

    def _inherit_limits(self, now: float) -> dict[str, LimitDecision]:
        """Unexpired discovered limits in the segment, as the previous sidecar left them
        (their deadlines as the segment holds them, on the deadline clock)."""
        data, _ = snapshot_bytes(self.seg.buf)
        mono = platform.deadline_now()
        kept = {}
        for seen in parse_view(self.segment_name, data, now=now, mono=mono).providers:
            if seen.expires_mono is not None:  # see it through the wall clock's frame now
                seen = dataclasses.replace(seen, expires_at=now + (seen.expires_mono - mono))
            decision = inherited_from_view(seen, now)
            if decision is not None:
                kept[seen.id] = _anchored(decision, now, mono, seen.expires_mono)
        return kept

    def _draining(self) -> bool:
        return bool(self.legacy)

    def redecide(self, state: ProviderState, now: float) -> LimitDecision:
        """Decide ``state``'s limit again at ``now`` and log it if it changed."""
        state.decision = self._decide(state, now)
        self._log_decision(state)
        return state.decision

    def redecide_all(self) -> None:
        now = time.time()
        for state in self.providers.values():
            self.redecide(state, now)

    def publish(self) -> None:
        if self.retired:
            return
        now = time.time()
        pubs = []
        for provider_id, state in self.providers.items():
            fallback, fallback_source = _fallback(state.decision, state.rules)
            if self.sharing is not None and state.rules.discovery_active:
                # what the handlers run on when no share is in force: 0, for good (no
                # reservation in Redis outlives a lease; docs/share.md)
                fallback, fallback_source = 0, SHARE
            status = self.config.statuses.get(provider_id)
            requested = status.discovery_requested if status else state.config.capacity_discovery
            built_from = (
                state.decision,
                fallback,
                fallback_source,
                requested,
                state.config.classes,
                state.config.default_class,
            )
            if state.publication is None or not _same(state.built_from, built_from):
                state.publication = _publication(
                    provider_id, state, fallback, fallback_source, requested=requested
                )
                state.built_from = built_from
            pubs.append(state.publication)
        try:
            warnings = writer.publish(
                self.seg,
                self.epoch,
                self.generation,
                self.config_status,
                pubs,
                now,
                self.out.cache,
            )
        except writer.Superseded as exc:
            self.retire(exc)
            return
        except Exception:
            self.log_unexpected("publication")
            return
        problem = self.out.reasons.write(texts_of(self.config_status, pubs))
        for w in [*warnings, *([problem] if problem else [])]:
            if self.out.first_time(w):  # R-P9: once per sidecar run, not every publication
                log.warning("%s", w)
        self._send_status()

    def _send_status(self) -> None:
        """``STATUS=`` for ``systemctl status``: the limit in force per provider,
        sent when it changes (a no-op outside systemd)."""
        if not self.out.ready:
            return
        text = status_line(
            [s.decision for s in self.providers.values()], self.config_status, len(self.legacy)
        )
        if text != self.out.status_sent and sdnotify.status(text):
            self.out.status_sent = text

    def _log_decision(self, state: ProviderState) -> None:
        d = state.decision
        if d is None:
            return
        # R-P9: a repeated state is logged once per change. Numbers in the reason are
        # not a change: a router whose clock lags says "stale (observed_at <new>)" at
        # every refresh; the limit itself is part of the key.
        key = (d.effective_limit, d.source, _NUMBERS.sub("#", d.reason))
        if key == state.logged:
            return
        state.logged = key
        # discovery that found no usable answer, or an opt-in that was refused, is worth
        # a warning, and so is a configured model the router does not report (a typo in
        # models holds the limit at 0); the rest is news
        failed = (
            d.source == d.fallback_source
            and (state.probe is not None or state.rules.refused_reason is not None)
        ) or bool(d.missing_models)
        log.log(
            logging.WARNING if failed else logging.INFO,
            "provider %s: limit %d (%s): %s",
            d.provider_id,
            d.effective_limit,
            d.source,
            d.reason,
            extra={"provider": d.provider_id, "limit": d.effective_limit, "source": d.source},
        )

    # --- housekeeping ------------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        last = {"config": 0.0, "drain": time.monotonic(), "segment": time.monotonic()}
        while True:
            try:
                if not self._housekeep(last):
                    return
            except Exception:  # one bad turn must not stop heartbeat and reaping
                if self.seg.core.lost:  # truncated during the turn
                    self._segment_gone()
                    return
                self.log_unexpected("housekeeping")
            await asyncio.sleep(TICK_S)

    def _housekeep(self, last: dict[str, float]) -> bool:
        """One turn of housekeeping; False when the sidecar is to stop."""
        now = time.time()
        if self.legacy.prune():
            log.info("legacy generation exited: the discovered budget applies now")
            self.redecide_all()
            self.publish()
        elif self.legacy and time.monotonic() - last["drain"] >= DRAIN_REPUBLISH_S:
            # A drain is asserted by this sidecar, not observed: keep it fresh so
            # it never lapses between refreshes, and lapses soon if we die (R-G3).
            last["drain"] = time.monotonic()
            self.redecide_all()
            self.publish()
        self.legacy.warn_if_overdue()
        if self.seg.core.lost:  # truncated under us: nothing of it can be written or read
            return self._segment_gone()
        try:
            reclaimed = writer.heartbeat(
                self.seg,
                self.epoch,
                now,
                len(self.legacy),
                legacy_since=self.legacy.since,
                legacy_max_s=self.legacy.max_s,
                legacy_pid=self.legacy.first_pid(),
            )
        except writer.Superseded as exc:
            self.retire(exc)
            return False
        if reclaimed:
            log.warning("reclaimed %d slot(s) held by dead processes", reclaimed)
        if self.parent is not None and self.parent.gone():
            log.info("parent process %d exited: stopping", self.opts.parent_pid)
            self.stop.set()
            return False
        if time.monotonic() - last["segment"] >= SEGMENT_CHECK_S:
            last["segment"] = time.monotonic()
            if not self.seg.still_named():
                return self._segment_gone()
        if time.monotonic() - last["config"] >= min(CONFIG_POLL_S, self.opts.refresh_s):
            last["config"] = time.monotonic()
            self._check_config()
        self._watchdog.maybe_ping(time.monotonic())
        self.metrics.turned()
        return True

    def log_unexpected(self, where: str) -> None:
        """Log an unexpected exception with its traceback, once per distinct message."""
        exc = sys.exc_info()[1]
        text = f"{where}: {type(exc).__name__}: {exc}"
        if self.out.first_time(text):
            log.exception("unexpected error in %s; carrying on", where)


def _first_config(path: str) -> tuple[GatewayConfig, tuple[int, int, int, int] | None]:
    """The config at start and its file's stamp; ``StartupError`` if it does not load, or
    if it asks for share mode without redis-py installed."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        raise StartupError(str(exc)) from None
    stamp = _stamp(path)
    if config.share is not None:
        try:
            import redis  # noqa: F401
        except ImportError:
            raise StartupError(
                "capacityShare needs redis-py: pip install 'gateway-capacity[share]'"
            ) from None
    return config, stamp


def _legacy_drain(options: Options) -> LegacyDrain:
    """The legacy processes ``--await-legacy`` names (R-G3), their pidfiles trusted as
    ``sidecar.legacy`` says, with the users ``--owner`` names."""
    proc_hides = proc_hides_other_users()
    if proc_hides:
        log.warning(
            "%s: processes of other users may be invisible here; one that kill(pid, 0) "
            "still finds is taken for alive, never for exited",
            proc_hides,
        )
    try:  # --owner (or $GATEWAY_CAPACITY_OWNER): trusted with the segment, and a pidfile
        named = OwnerPolicy.for_process(options.owner).uids
    except OwnerError as exc:
        raise StartupError(str(exc)) from None
    return LegacyDrain(
        parse_legacy(
            options.await_legacy,
            options.await_legacy_grace_s,
            proc_hides,
            forbidden_legacy_pids(options.parent_pid),
            trusted=[uid for uid in named if uid != os.geteuid()],
        ),
        options.await_legacy_max_s,
    )


def _parent_watch(parent_pid: int | None) -> ParentWatch | None:
    if parent_pid is None:
        return None
    try:
        return ParentWatch(parent_pid)  # pid reuse cannot fool it
    except ProcessLookupError:
        raise StartupError(f"--parent-pid {parent_pid}: no such process") from None


def _serve_metrics(
    listen: str | None, segment_name: str, metrics: SidecarMetrics
) -> ThreadingWSGIServer | None:
    """The ``--metrics-listen`` server, serving already (metrics are off without it)."""
    if not listen:
        return None
    from sidecar.metrics import serve_metrics

    host, port = parse_listen(listen)
    try:
        server = serve_metrics(host, port, segment_name, metrics)
    except OSError as exc:
        raise StartupError(
            f"--metrics-listen {listen}: cannot listen: {exc.strerror or exc}"
        ) from None
    bound_host, bound_port = server.server_address[:2]
    bound_host = str(bound_host)  # an AF_INET/AF_INET6 address: str already
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    log.info("metrics on http://%s:%d/metrics, health on /healthz", shown, bound_port)
    exposed = metrics_exposure(listen, bound_host)
    if exposed is not None:
        log.warning("%s", exposed)
    return server


def status_line(
    decisions: Sequence[LimitDecision | None], config_status: str = "ok", legacy: int = 0
) -> str:
    """E.g. ``local-inference=20 (discovered), static=4 (provider)``."""
    parts = [f"{d.provider_id}={d.effective_limit} ({d.source})" for d in decisions if d]
    text = ", ".join(parts) if parts else "no providers"
    if legacy:
        text += f"; waiting for {legacy} legacy process(es)"
    if config_status != "ok":
        text += f"; config: {config_status}"
    return text


def metrics_exposure(listen: str, bound_host: str) -> str | None:
    """The WARNING for ``--metrics-listen`` on an address that is not loopback:
    what is served, to whom, and unauthenticated; ``None`` on loopback."""
    ip = parse_ip(bound_host)
    if ip is not None and is_loopback(ip):
        return None
    where = (
        "every network this host is on"
        if ip is not None and ip.is_unspecified
        else f"the network of {bound_host}"
    )
    return (
        f"--metrics-listen {listen} is not loopback: the metrics (provider ids, limits, "
        "running and waiting counts, probe outcomes, the segment name) and /healthz are "
        f"served without authentication to {where}. Bind 127.0.0.1 unless a scraper "
        "elsewhere needs them, and then firewall the port"
    )


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``; an empty host is 127.0.0.1); ``StartupError`` if not."""
    try:
        return parse_host_port(listen, empty_host="127.0.0.1")
    except ValueError:
        raise StartupError(
            f"--metrics-listen {listen}: expected HOST:PORT or [IPv6]:PORT, e.g. 127.0.0.1:9464"
        ) from None


def _fallback(decision: LimitDecision | None, rules: ProviderRules) -> tuple[int, Source]:
    if decision is not None:
        return decision.fallback_limit, decision.fallback_source
    return fallback_for(rules.provider_max, rules.gateway_max)


def _publication(
    provider_id: str,
    state: ProviderState,
    fallback: int,
    fallback_source: Source,
    *,
    requested: bool,
) -> writer.Publication:
    d = state.decision
    discovery = requested  # "capacity_discovery" = requested in the file, active or not
    classes = state.config.class_specs  # admission classes (docs/classes.md)
    default_class = state.config.default_class_index
    if d is None:
        return writer.Publication(
            provider_id,
            discovery,
            fallback,
            fallback_source,
            classes=classes,
            default_class=default_class,
        )
    replicas = [
        ReplicaView(
            address=r.address,
            ok=r.ok,
            complete=r.complete,
            value=r.value,
            reason=(f"{r.reason}: {r.detail}" if r.detail else r.reason),
            observed_at=r.observed_at,
        )
        for r in d.replicas
    ]
    enforced = d.source in (DISCOVERED, LEGACY_DRAIN, SHARE) and d.expires_at is not None
    return writer.Publication(
        provider_id=provider_id,
        discovery=discovery,
        fallback=fallback,
        fallback_source=fallback_source,
        limit=d.effective_limit if enforced else None,
        source=d.source,
        reason=d.reason,
        discovered=d.discovered,
        observed_at=d.observed_at,
        expires_at=d.expires_at if enforced else None,
        expires_mono=d.expires_mono if enforced else None,
        replicas=replicas,
        classes=classes,
        default_class=default_class,
        # R-L10: the token budget lapses with the limit; in share mode it is this
        # gateway's token share (sidecar.shares), the per-request bound the workers' own
        token_limit=d.token_limit if enforced else 0,
        request_token_limit=d.request_token_limit if enforced else 0,
    )


def _anchored(
    d: LimitDecision, now: float, mono: float, expires_mono: float | None = None
) -> LimitDecision:
    """``d`` with its expiry fixed on the deadline clock: ``expires_at`` (judged in the
    wall clock's frame at ``now``) becomes ``mono`` + what is left of it (R-L7)."""
    if d.expires_at is None:
        return d
    if expires_mono is None:
        expires_mono = mono + (d.expires_at - now)
    return dataclasses.replace(d, expires_mono=expires_mono)


def _seen_at(d: LimitDecision, now: float, mono: float) -> LimitDecision:
    """A decision made earlier, seen through the wall clock's frame at ``now``: its
    ``expires_at`` is what its fixed deadline leaves, however the wall clock stepped."""
    if d.expires_mono is None:
        return d
    return dataclasses.replace(d, expires_at=now + (d.expires_mono - mono))


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Same decision object and same values: the publication built from it still holds."""
    return len(a) == len(b) and a[0] is b[0] and a[1:] == b[1:]


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def main(options: Options) -> int:
    # Until run() installs the reload handler, a SIGHUP (systemctl kill -s HUP) must
    # not end the sidecar: systemd counts death by SIGHUP as a clean exit.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        sidecar = Sidecar(options)
    except ForeignSegment as exc:
        # Another user's object under our name: not a mistake in our configuration that a
        # restart cannot mend (it may be removed meanwhile), so exit 1 and let
        # Restart=on-failure try again, each time saying why.
        log.error("cannot start: %s", exc)
        return 1
    except GatewayCapacityError as exc:  # StartupError, SegmentError, BadSegmentName ...
        log.error("cannot start: %s", exc)
        return 2
    return asyncio.run(sidecar.run())
