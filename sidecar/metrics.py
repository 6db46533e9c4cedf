"""Prometheus metrics of the sidecar, labelled ``provider`` (REQUIREMENTS.md section 8).

Off by default (``--metrics-listen HOST:PORT``). Names follow Prometheus's
naming conventions: base units (seconds), ``_total`` for counters,
``_timestamp_seconds`` for points in time, ``_info`` for build information,
and no sentinel values: a figure that does not exist (no discovered limit, no
snapshot) is an absent series, never -1 or 0. ``docs/metrics.md`` lists every
metric; ``tests/sidecar/test_metrics_e2e.py`` scrapes a real sidecar against it.

Two kinds of figures:

* the segment's (limits, running, waiting, the handlers' counters, lock
  recoveries), read lock-free at every scrape, so they are the handlers' live
  figures and survive sidecar restarts (counters count from the segment's
  creation);
* the sidecar's own (probe outcomes and durations, process metrics), which
  count from this sidecar's start, as counters of a process do.

``/metrics`` serves the exposition (only that path; others are 404) and
``/healthz`` answers 200 while the sidecar's event loop turns, 503 otherwise.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from shm_layout import layout
from shm_layout.errors import SegmentError
from shm_layout.view import SegmentView, read_view
from sidecar.limits import SOURCES
from sidecar.replica import REASONS

NAMESPACE: Final = "gateway_capacity"
# No ``_created`` series: the classic text format, which most scrapers ask for,
# would show each as a separate gauge family beside its counter.
disable_created_metrics()  # type: ignore[no-untyped-call]
# Reasons a probe is refused before anything is sent (sidecar.probe), beside the
# per-replica outcomes: together the closed set of the ``reason`` label.
REFUSED_REASONS: Final = frozenset({"not_requested", "config_invalid", "opt_in_refused"})
PROBE_REASONS: Final = tuple(sorted(REASONS | REFUSED_REASONS))
# A whole probe has a 3 s deadline (R-P5): buckets resolve loopback answers (ms)
# as well as a deadline that is being hit.
PROBE_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0)
# /healthz: the housekeeping loop turns every 0.5 s; ten missed turns is not alive.
HEALTHY_WITHIN_S: Final = 5.0


def _version() -> str:
    try:
        return metadata.version("gateway-capacity")
    except metadata.PackageNotFoundError:
        return "unknown"


class SidecarMetrics:
    """The sidecar's own figures, recorded by the daemon, and its liveness for /healthz."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.probe_results = Counter(
            "probe_results",
            "Outcomes of capacity probes: one per replica per refresh, or one per refresh "
            "when the probe was refused before anything was sent",
            ["provider", "reason"],
            namespace=NAMESPACE,
            registry=self.registry,
        )
        self.probe_duration = Histogram(
            "probe_duration_seconds",
            "Time one probe of a provider took, all replicas, DNS and address checks included",
            ["provider"],
            namespace=NAMESPACE,
            buckets=PROBE_BUCKETS,
            registry=self.registry,
        )
        # share mode only (capacityShare): absent series otherwise
        self._share_calls: Counter | None = None
        self._share_gauges: dict[str, Gauge] = {}
        self._share_outage: tuple[Gauge, Gauge] | None = None
        self._known: set[str] = set()
        self._lock = threading.Lock()
        self._last_turn: float | None = None  # monotonic
        # providers that ask for discovery and are refused before anything is sent:
        # provider -> (reason label, refresh period, monotonic time of the next count)
        self._refused: dict[str, tuple[str, float, float]] = {}

    def record_probe(self, provider: str, reasons: Iterable[str], seconds: float) -> None:
        """One probe of ``provider``: its outcomes (closed names) and how long it took."""
        with self._lock:
            if provider not in self._known:
                # every reason exists from the first probe on, so rate() and alerts see
                # a 0 -> 1 step instead of a series appearing out of nowhere
                self._known.add(provider)
                for reason in PROBE_REASONS:
                    self.probe_results.labels(provider, reason)
        for reason in reasons:
            self.probe_results.labels(provider, reason).inc()
        self.probe_duration.labels(provider).observe(seconds)

    def not_probed(self, provider: str, refused: str | None, refresh_s: float) -> None:
        """``provider`` asks for discovery and its entry is refused before anything is
        sent (``refused`` is the rules' ``discovery refused: <reason>:<detail>``): it
        counts one ``reason`` per refresh, as a probe would, from now on, so a provider
        left on its fallback by a refused opt-in or an invalid entry shows in
        ``probe_results_total`` and its alerts. ``None``: it is probed, or asks for
        nothing; such counting stops."""
        if refused is None:
            self._refused.pop(provider, None)
            return
        (reason,) = probe_reasons(refused.removeprefix("discovery refused: "), ())
        current = self._refused.get(provider)
        if current is None or current[:2] != (reason, refresh_s):
            self._refused[provider] = (reason, refresh_s, time.monotonic())
            self._count_refused()

    def _count_refused(self) -> None:
        now = time.monotonic()
        for provider, (reason, refresh_s, due) in list(self._refused.items()):
            if now >= due:
                self.record_probe(provider, (reason,), 0.0)
                self._refused[provider] = (reason, refresh_s, max(due + refresh_s, now))

    def forget(self, provider: str) -> None:
        """``provider`` left the config: its series go (they would never change again)."""
        self._refused.pop(provider, None)
        with self._lock:
            if provider not in self._known:
                return
            self._known.discard(provider)
            for reason in PROBE_REASONS:
                self.probe_results.remove(provider, reason)
            self.probe_duration.remove(provider)

    def share_call(self, provider: str, result: str) -> None:
        """One lease call to Redis for ``provider`` (share mode): ``ok``, ``unavailable``
        or why the table changed nothing (``duplicate``, ``stale``)."""
        if self._share_calls is None:
            self._share_calls = Counter(
                "share_calls",
                "Lease calls to Redis in share mode, by outcome (ok, unavailable, "
                "duplicate, stale, crowded, rule)",
                ["provider", "result"],
                namespace=NAMESPACE,
                registry=self.registry,
            )
        self._share_calls.labels(provider, result).inc()

    def share_refused(self) -> None:
        """The table refused this instance: another holds its gateway name, more
        gateways than declared are live, or the live ones declare another outage rule
        (``share_calls_total``'s result says which)."""
        self._share_gauge(
            "share_gateway_refused",
            "1 when the share table refuses this gateway: its name held by another "
            "instance, more gateways live than declared, or another outage rule (share mode)",
        ).set(1)

    def share_outage(self, provider: str, part: int, keeping: bool) -> None:  # noqa: FBT001
        """``provider``'s outage part (0: it holds 0 through an outage) and whether it
        runs on that part alone now (its lease lapsed, or no grant yet)."""
        if self._share_outage is None:
            self._share_outage = (
                Gauge(
                    "share_outage_part",
                    "What this gateway keeps of the capacity through a Redis outage, "
                    "outside the share table (0: it holds 0; share mode)",
                    ["provider"],
                    namespace=NAMESPACE,
                    registry=self.registry,
                ),
                Gauge(
                    "share_outage_keeping",
                    "1 while this gateway runs on its outage part alone, without a grant "
                    "from Redis (share mode)",
                    ["provider"],
                    namespace=NAMESPACE,
                    registry=self.registry,
                ),
            )
        part_gauge, keeping_gauge = self._share_outage
        part_gauge.labels(provider).set(part)
        keeping_gauge.labels(provider).set(1 if keeping else 0)

    def share_reachable(self, up: bool) -> None:  # noqa: FBT001 (a setter of one flag)
        """1 while Redis answers this sidecar's lease calls, 0 while it does not."""
        self._share_gauge(
            "share_redis_up",
            "1 while Redis answers the share-mode lease calls, 0 while it does not",
        ).set(1 if up else 0)

    def _share_gauge(self, name: str, documentation: str) -> Gauge:
        """A share mode gauge, registered at its first use: absent outside share mode."""
        gauge = self._share_gauges.get(name)
        if gauge is None:
            gauge = self._share_gauges[name] = Gauge(
                name, documentation, namespace=NAMESPACE, registry=self.registry
            )
        return gauge

    def turned(self) -> None:
        """The event loop made one turn of housekeeping (for /healthz); refused
        providers count their refresh when it is due."""
        self._last_turn = time.monotonic()
        self._count_refused()

    def health(self) -> tuple[bool, str]:
        last = self._last_turn
        if last is None:
            return False, "starting: the sidecar has not published yet"
        age = time.monotonic() - last
        if age > HEALTHY_WITHIN_S:
            return False, f"stalled: the sidecar's loop last turned {age:.1f} s ago"
        return True, "ok"


def probe_reasons(refused: str | None, replica_reasons: Iterable[str]) -> list[str]:
    """The ``reason`` label values of one probe (``refused`` is ``<reason>:<detail>``)."""
    if refused is not None:
        return [refused.partition(":")[0]]
    return list(replica_reasons)


class SegmentCollector(Collector):
    """The segment's figures, read at every scrape."""

    def __init__(self, segment: str) -> None:
        self.segment = segment

    def collect(self) -> Iterator[Metric]:
        build = InfoMetricFamily(
            f"{NAMESPACE}_build", "Version of gateway-capacity and of its segment layout"
        )
        build.add_metric([], {"version": _version(), "layout": f"{layout.MAJOR}.{layout.MINOR}"})
        yield build
        try:
            view = read_view(self.segment)
        except SegmentError:
            # absent series say "no segment"; the sidecar itself notices and exits
            return
        yield from _segment_metrics(view)


def _gauge(name: str, doc: str, labels: Iterable[str] = ("provider",)) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, labels=list(labels))


# (metric name without namespace and _total, counter in the segment, help)
_SEGMENT_COUNTERS: Final = (
    ("requests_admitted", "admitted_total", "Requests admitted to a slot"),
    ("requests_rejected", "rejected_total", "Requests refused at once: the queue was full"),
    ("requests_timed_out", "timeouts_total", "Requests that waited until their timeout"),
    ("requests_cancelled", "cancelled_total", "Waiting requests cancelled by their caller"),
    (
        "holders_reclaimed",
        "reclaimed_total",
        "Running slots and waiting places of dead processes that were reclaimed",
    ),
    (
        "requests_promoted",
        "promoted_total",
        "Grants that only a waiter's promotion after its class's maxWait allowed",
    ),
    (
        "requests_displaced",
        "displaced_total",
        "Waiters displaced from a full queue by a request of a higher admission class",
    ),
)


def _segment_metrics(view: SegmentView) -> Iterator[Metric]:
    now = view.read_at
    limit = _gauge("effective_limit", "Admission limit in force (requests running at once)")
    source = _gauge(
        "limit_source",
        "1 for the source of the limit in force, 0 for the others",
        ("provider", "source"),
    )
    running = _gauge("running", "Requests running (holders of live processes)")
    waiting = _gauge("waiting", "Requests waiting (holders of live processes)")
    queue = _gauge("queue_bound", "Most requests that may wait at once")
    fallback = _gauge("fallback_limit", "Static limit applied when no discovered limit is in force")
    discovered = _gauge(
        "discovered_limit", "Limit computed from the last valid snapshots (absent: none)"
    )
    observed = _gauge(
        "snapshot_observed_timestamp_seconds",
        "observed_at of the oldest snapshot the discovered limit was computed from",
    )
    age = _gauge(
        "snapshot_age_seconds",
        "Age of that snapshot by the sidecar's clock (a discovered limit expires at 30 s)",
    )
    expiry = _gauge(
        "limit_expiry_timestamp_seconds",
        "When the published limit lapses to the fallback (absent: nothing published)",
    )
    counters = [
        CounterMetricFamily(
            f"{NAMESPACE}_{name}",
            f"{doc}, since the segment was created",
            labels=["provider"],
        )
        for name, _, doc in _SEGMENT_COUNTERS
    ]
    class_labels = ("provider", "class")
    class_running = _gauge("class_running", "Requests running, by admission class", class_labels)
    class_waiting = _gauge("class_waiting", "Requests waiting, by admission class", class_labels)
    class_admitted = CounterMetricFamily(
        f"{NAMESPACE}_class_requests_admitted",
        "Requests admitted to a slot, by admission class, since the classes were written",
        labels=list(class_labels),
    )
    tokens_running = _gauge(
        "tokens_running", "Tokens charged to running requests (holders of live processes)"
    )
    token_limit = _gauge(
        "token_limit",
        "Tokens all running requests may hold together (absent: no token budget in force)",
    )
    request_token_limit = _gauge(
        "request_token_limit", "The most tokens one request may hold (absent: unknown)"
    )
    tokens_suspended = _gauge(
        "tokens_suspended",
        "1 while a token budget is published but a layout 3.1 or older handler is registered",
    )
    for p in view.providers:
        labels = [p.id]
        tokens_running.add_metric(labels, p.tokens_running)
        tokens_suspended.add_metric(labels, 1.0 if p.tokens_suspended else 0.0)
        if p.token_limit is not None:
            token_limit.add_metric(labels, p.token_limit)
        if p.request_token_limit is not None:
            request_token_limit.add_metric(labels, p.request_token_limit)
        for c in p.classes:
            class_running.add_metric([p.id, c.name], c.running)
            class_waiting.add_metric([p.id, c.name], c.waiting)
            class_admitted.add_metric([p.id, c.name], c.admitted_total)
        limit.add_metric(labels, p.effective_limit)
        for name in sorted(SOURCES):
            source.add_metric([p.id, name], 1.0 if name == p.source else 0.0)
        running.add_metric(labels, p.running)
        waiting.add_metric(labels, p.waiting)
        queue.add_metric(labels, p.queue_bound)
        fallback.add_metric(labels, p.fallback_limit)
        if p.discovered is not None:
            discovered.add_metric(labels, p.discovered)
        if p.observed_at is not None:
            observed.add_metric(labels, p.observed_at)
            age.add_metric(labels, max(0.0, now - p.observed_at))
        if p.expires_at is not None:
            expiry.add_metric(labels, p.expires_at)
        for family, (_, key, _) in zip(counters, _SEGMENT_COUNTERS, strict=True):
            family.add_metric(labels, p.counters[key])
    yield from (limit, source, running, waiting, queue, fallback, discovered)
    yield from (observed, age, expiry)
    yield from counters
    yield from (class_running, class_waiting, class_admitted)
    yield from (tokens_running, token_limit, request_token_limit, tokens_suspended)

    handlers = _gauge(
        "handler_processes", "Live handler processes attached, by generation", ("generation",)
    )
    live: dict[str, int] = {}
    for m in view.members:
        if m.alive:
            live[m.generation] = live.get(m.generation, 0) + 1
    for generation, count in sorted(live.items()):
        handlers.add_metric([generation], count)
    yield handlers

    recoveries = CounterMetricFamily(
        f"{NAMESPACE}_lock_recoveries",
        "Times a process died holding the segment lock and the next holder repaired the "
        "counters from the holder records (R-A6), since the segment was created",
    )
    recoveries.add_metric([], view.lock_repairs)
    yield recoveries

    config_ok = GaugeMetricFamily(
        f"{NAMESPACE}_config_last_reload_successful",
        "1 when the sidecar runs on the config file as it is now, 0 when a broken edit "
        "was ignored and the last good config is kept",
    )
    config_ok.add_metric([], 1.0 if view.config_status in ("", "ok") else 0.0)
    yield config_ok

    s = view.sidecar
    if s is not None and s.heartbeat_age_s is not None:
        heartbeat = GaugeMetricFamily(
            f"{NAMESPACE}_sidecar_heartbeat_age_seconds",
            "Seconds since the sidecar's last heartbeat in the segment (every 0.5 s)",
        )
        heartbeat.add_metric([], max(0.0, s.heartbeat_age_s))
        yield heartbeat
        legacy = GaugeMetricFamily(
            f"{NAMESPACE}_legacy_processes",
            "Legacy handler processes (--await-legacy) still alive: while above 0, "
            "opted-in providers drain",
        )
        legacy.add_metric([], s.legacy_alive)
        yield legacy


def build_registry(segment: str, sidecar: SidecarMetrics) -> CollectorRegistry:
    """The sidecar's figures, the segment's and the process's, in one registry."""
    registry = sidecar.registry
    registry.register(SegmentCollector(segment))
    ProcessCollector(registry=registry)
    return registry


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _app(
    registry: CollectorRegistry, health: Callable[[], tuple[bool, str]]
) -> Callable[..., Iterable[bytes]]:
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if path not in ("/metrics", "/healthz"):
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: metrics are on /metrics, health on /healthz\n"]
        if method not in ("GET", "HEAD"):
            start_response(
                "405 Method Not Allowed",
                [("Allow", "GET, HEAD"), ("Content-Type", "text/plain; charset=utf-8")],
            )
            return [b"method not allowed: use GET\n"]
        if path == "/metrics":
            if method == "HEAD":
                environ = {**environ, "REQUEST_METHOD": "GET"}
            body: Iterable[bytes] = metrics_app(environ, start_response)
            return [] if method == "HEAD" else body
        ok, text = health()
        start_response(
            "200 OK" if ok else "503 Service Unavailable",
            [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")],
        )
        return [] if method == "HEAD" else [text.encode() + b"\n"]

    return app


def serve_metrics(
    host: str, port: int, segment: str, sidecar: SidecarMetrics
) -> ThreadingWSGIServer:
    """Serve ``/metrics`` and ``/healthz`` from a thread; returns the server.

    ``.server_address`` says the bound address; ``.shutdown()`` then
    ``.server_close()`` stop it. Raises ``OSError`` when it cannot listen.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    registry = build_registry(segment, sidecar)
    server = make_server(
        str(sockaddr[0]), port, _app(registry, sidecar.health), Server, handler_class=_Quiet
    )
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server
