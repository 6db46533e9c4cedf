"""Prometheus metrics of the sidecar's segment, labelled ``provider`` (REQUIREMENTS.md section 8).

Off by default (``--metrics-listen HOST:PORT``). Every scrape reads the segment
lock-free, so the figures are the handlers' live ones, not the sidecar's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shm_layout.view import read_view


class SegmentCollector(Collector):
    def __init__(self, segment: str) -> None:
        self.segment = segment

    def collect(self) -> Iterator[Any]:
        view = read_view(self.segment)
        gauges = {
            "effective_limit": "Admission limit in force",
            "running": "Requests running (live holders)",
            "waiting": "Requests waiting (live holders)",
            "fallback_limit": "Static limit used when nothing discovered is in force",
            "discovered": "Last discovered limit (-1: none)",
            "expires_at": "When the published limit expires (Unix seconds, 0: none)",
        }
        families = {
            k: GaugeMetricFamily(f"gateway_capacity_{k}", doc, labels=["provider"])
            for k, doc in gauges.items()
        }
        source = GaugeMetricFamily(
            "gateway_capacity_limit_source",
            "1 for the source of the limit in force",
            labels=["provider", "source"],
        )
        counters = {
            k: CounterMetricFamily(
                f"gateway_capacity_{k}", f"{k} since the segment was created", labels=["provider"]
            )
            for k in ("admitted", "rejected", "timeouts", "cancelled", "reclaimed")
        }
        for p in view.providers:
            values = {
                "effective_limit": p.effective_limit,
                "running": p.running,
                "waiting": p.waiting,
                "fallback_limit": p.fallback_limit,
                "discovered": -1 if p.discovered is None else p.discovered,
                "expires_at": p.expires_at or 0.0,
            }
            for k, v in values.items():
                families[k].add_metric([p.id], float(v))
            source.add_metric([p.id, p.source], 1.0)
            for k, fam in counters.items():
                fam.add_metric([p.id], float(p.counters[f"{k}_total"]))
        yield from families.values()
        yield source
        yield from counters.values()
        heartbeat = GaugeMetricFamily(
            "gateway_capacity_sidecar_heartbeat_age_seconds", "Seconds since the last heartbeat"
        )
        if view.sidecar is not None and view.sidecar.heartbeat_age_s is not None:
            heartbeat.add_metric([], view.sidecar.heartbeat_age_s)
        yield heartbeat


def serve_metrics(host: str, port: int, segment: str) -> Any:
    """Start the metrics HTTP server in a thread; returns the server (``.shutdown()``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SegmentCollector(segment))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
