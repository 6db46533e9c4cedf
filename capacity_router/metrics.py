"""``GET /metrics`` on ``router serve``: the last round in Prometheus text (R-K5).

Built at every scrape from values the poller swaps whole (the snapshot, the
workers' statuses) and the relay's in-flight counts, by prometheus_client
(its families, registry and ``generate_latest``: names and label values are
escaped by the library). It names workers, so ``app.py`` answers it to the key
holder on loopback only, like ``/admin/workers``. No URL, reason text or key
is ever a label.

Series (prefix ``gateway_capacity_router_``):

- ``model_capacity{model}``: the snapshot's ``max_concurrent_requests``.
- ``snapshot_complete``: 1 when every unfenced worker was read, else 0.
- ``last_round_timestamp_seconds``: the snapshot's ``observed_at``.
- ``worker_state{worker,gateway_capacity_router_worker_state}``: a state set
  (ok, unreadable, unhealthy, unreachable, fenced), exactly one 1 per worker.
- ``worker_slots{worker}``: the slots counted for an ok worker.
- ``worker_running_requests{worker}`` and ``worker_waiting_requests{worker}``:
  what the server says it runs and queues (llama.cpp ``/slots``, SGLang
  ``/v1/loads``, vLLM's and TGI's gauges), only for servers that say it.
- ``worker_relayed_requests{worker}``: the requests this router relays to it now.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric, StateSetMetricFamily
from prometheus_client.registry import Collector

from capacity_contract import CapacitySnapshot

from .poller import WorkerStatus

NAMESPACE = "gateway_capacity_router"
CONTENT_TYPE = CONTENT_TYPE_LATEST
WORKER_STATES = ("ok", "unreadable", "unhealthy", "unreachable", "fenced")


class _RoundCollector(Collector):
    def __init__(
        self,
        snapshot: CapacitySnapshot | None,
        workers: Sequence[WorkerStatus],
        in_flight: Mapping[str, int],
    ) -> None:
        self._snapshot = snapshot
        self._workers = workers
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot
        if snapshot is not None:
            capacity = _gauge(
                "model_capacity", "The snapshot's max_concurrent_requests per model", ["model"]
            )
            for row in snapshot.models:
                capacity.add_metric([row.id], row.max_concurrent_requests)
            yield capacity
            complete = _gauge(
                "snapshot_complete", "1 when the last round read every unfenced worker"
            )
            complete.add_metric([], 1 if snapshot.complete else 0)
            yield complete
            observed = _gauge(
                "last_round_timestamp_seconds", "Unix time the last observation round started"
            )
            observed.add_metric([], snapshot.observed_at)
            yield observed
        state = StateSetMetricFamily(
            f"{NAMESPACE}_worker_state", "Each worker's state in the last round", labels=["worker"]
        )
        slots = _gauge("worker_slots", "Slots counted for each ok worker", ["worker"])
        running = _gauge(
            "worker_running_requests",
            "Requests the worker says it runs now (servers that tell it)",
            ["worker"],
        )
        waiting = _gauge(
            "worker_waiting_requests",
            "Requests the worker says it holds in its own queue (servers that tell it)",
            ["worker"],
        )
        relayed = _gauge(
            "worker_relayed_requests", "Requests this router relays to the worker now", ["worker"]
        )
        for status in self._workers:
            now = "fenced" if status.fenced or status.state is None else status.state
            state.add_metric([status.id], {s: s == now for s in WORKER_STATES})
            if status.slots is not None:
                slots.add_metric([status.id], status.slots)
            if status.running is not None:
                running.add_metric([status.id], status.running)
            if status.waiting is not None:
                waiting.add_metric([status.id], status.waiting)
            relayed.add_metric([status.id], self._in_flight.get(status.id, 0))
        yield from (state, slots, running, waiting, relayed)


def _gauge(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", doc, labels=list(labels))


def exposition(
    snapshot: CapacitySnapshot | None,
    workers: Sequence[WorkerStatus],
    in_flight: Mapping[str, int],
) -> bytes:
    """The Prometheus text of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RoundCollector(snapshot, workers, in_flight))
    return generate_latest(registry)
