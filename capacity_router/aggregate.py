"""R-K5 as one pure function: registry + fences + observations -> snapshot.

No I/O and no clock: the poller passes ``observed_at``. Rules, per model id:

- only registered workers count (``workers``), each identity once, however
  many URLs reached it and however often it is listed;
- fenced workers (in the file or by the admin endpoint) do not count;
- unhealthy and unreachable workers do not count and do not spoil
  completeness: they are simply absent;
- a healthy (answering) worker whose slots cannot be read makes the snapshot
  ``complete: false``. A model whose only answering workers are unreadable
  gets no row at all: in an incomplete snapshot a missing row means
  "unknown", while a row of 0 would drain it;
- aliases on one worker share its scheduler: the worker's slots count once
  for each model id it serves (a repeated id counts once);
- a worker that reports per model (``Observation.per_model``: ids it says it
  does not serve, a multi-model server's unloaded models) counts that number
  for each id, 0 for an id it does not list; an id in ``Observation.unknown``
  (a model loading now) is unreadable for that id alone;
- every registered model id has a row (0 when nothing serves it now), sorted
  by id, each count capped at the contract's maximum;
- a row carries the token fields (R-K7) only when every worker counted for it
  (ok, with a slot or more for it) states them: ``max_request_tokens`` the
  largest over those workers (a request that fits one of them can run: the
  relay routes it there), ``max_running_tokens`` their sum, capped at the
  contract's bound. One worker that does not state a field leaves it out: its
  requests are bounded by nothing we know.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec

from capacity_contract import (
    MAX_SLOTS,
    MAX_SNAPSHOT_BYTES,
    MAX_TOKENS,
    CapacitySnapshot,
    ModelCapacity,
    encode_snapshot,
)

from .registry import Worker

State = Literal["ok", "unreadable", "unhealthy", "unreachable"]


@dataclass(frozen=True, slots=True)
class Observation:
    """What one poll found about one worker.

    ``ok``: healthy, ``slots`` read. ``unreadable``: it answers and says it is
    healthy, but its slot count could not be read. ``unhealthy``: it answered
    that it cannot serve (e.g. 503 while loading). ``unreachable``: no answer.
    ``reason`` is a short phrase for logs; it never reaches the wire.

    With ``per_model`` (``ok`` only) each registered id counts its own number
    (absent: 0) instead of ``slots``; ``unknown`` ids are unreadable now;
    ``unserved`` are the registered ids the worker says it does not serve;
    ``activity`` is what the worker says it is doing (``router show`` only),
    ``running`` and ``waiting`` its figures where the server tells them (the
    router's ``/metrics``);
    ``unlisted`` are registered ids it does not list but counts all the same
    (a server that answers any model with its one). ``request_tokens`` and
    ``running_tokens`` are its token capacity where it states it (R-K7),
    ``tokens_from`` says where from (and why lowered, ``reconcile.py``);
    ``preemptions`` and ``kv_usage`` are what reconciliation reads.
    """

    state: State
    slots: int | None = None
    reason: str = ""
    per_model: Mapping[str, int] | None = None
    unknown: frozenset[str] = frozenset()
    unserved: tuple[str, ...] = ()
    activity: str = ""
    unlisted: tuple[str, ...] = ()
    running: float | None = None
    waiting: float | None = None
    request_tokens: int | None = None
    running_tokens: int | None = None
    tokens_from: str = ""
    preemptions: float | None = None
    kv_usage: float | None = None

    def __post_init__(self) -> None:
        if (self.state == "ok") != (self.slots is not None):
            raise ValueError("slots is set exactly when state is 'ok'")
        if self.per_model is not None and self.state != "ok":
            raise ValueError("per_model is set only when state is 'ok'")

    def count_for(self, model: str) -> int:
        assert self.slots is not None
        if self.per_model is None:
            return self.slots
        return self.per_model.get(model, 0)


def is_fenced(worker: Worker, admin_fenced: Collection[str]) -> bool:
    return worker.fenced or worker.id in admin_fenced


def aggregate(
    workers: Iterable[Worker],
    admin_fenced: Collection[str],
    observations: Mapping[str, Observation],
    observed_at: float,
) -> CapacitySnapshot:
    totals: dict[str, int] = {}
    request_tokens: dict[str, int | None] = {}  # None: a counted worker does not say
    running_tokens: dict[str, int | None] = {}
    read: set[str] = set()
    unknown: set[str] = set()
    complete = True
    seen: set[str] = set()
    for worker in workers:
        if worker.id in seen:
            continue
        seen.add(worker.id)
        served = dict.fromkeys(worker.models)  # each alias once, order kept
        for model in served:
            totals.setdefault(model, 0)
        if is_fenced(worker, admin_fenced):
            continue
        obs = observations.get(worker.id)
        if obs is None or obs.state in ("unhealthy", "unreachable"):
            continue
        if obs.state == "unreadable":
            complete = False
            unknown.update(served)
            continue
        for model in served:
            if model in obs.unknown:
                complete = False
                unknown.add(model)
                continue
            count = obs.count_for(model)
            totals[model] += count
            read.add(model)
            if count > 0:
                request_tokens[model] = _largest(request_tokens.get(model, 0), obs.request_tokens)
                running_tokens[model] = _added(running_tokens.get(model, 0), obs.running_tokens)
    rows = [
        _row(model, total, request_tokens.get(model), running_tokens.get(model))
        for model, total in sorted(totals.items())
        if model in read or model not in unknown
    ]
    return CapacitySnapshot(
        object="inference_capacity",
        version=1,
        complete=complete,
        observed_at=observed_at,
        models=rows,
    )


def _largest(so_far: int | None, stated: int | None) -> int | None:
    return None if so_far is None or stated is None else max(so_far, stated)


def _added(so_far: int | None, stated: int | None) -> int | None:
    return None if so_far is None or stated is None else min(so_far + stated, MAX_TOKENS)


def _row(model: str, total: int, request: int | None, running: int | None) -> ModelCapacity:
    row = ModelCapacity(id=model, max_concurrent_requests=min(total, MAX_SLOTS))
    if request:  # 0: no worker counted (the field means "unknown" then)
        row.max_request_tokens = min(request, MAX_TOKENS)
    if running:
        row.max_running_tokens = running
    return row


def within_contract(snapshot: CapacitySnapshot) -> tuple[CapacitySnapshot, bytes, str | None]:
    """What to serve for ``snapshot``: itself and its body when the body is within the
    contract's size bound (R-P6), else the same marked ``complete: false`` without the
    rows that do not fit (the longest ids; a missing row means "unknown"), and why.

    The registry refuses ids that could pass the bound, so this is the last line only:
    the router never serves a body every reader would refuse."""
    body = encode_snapshot(snapshot)
    if len(body) <= MAX_SNAPSHOT_BYTES:
        return snapshot, body, None
    fitted = CapacitySnapshot(
        object=snapshot.object,
        version=snapshot.version,
        complete=False,
        observed_at=snapshot.observed_at,
        models=[],
    )
    size = len(encode_snapshot(fitted))
    for row in sorted(snapshot.models, key=lambda r: (len(msgspec.json.encode(r)), r.id)):
        grown = size + len(msgspec.json.encode(row)) + (1 if fitted.models else 0)
        if grown > MAX_SNAPSHOT_BYTES:
            break
        fitted.models.append(row)
        size = grown
    fitted.models.sort(key=lambda r: r.id)
    why = (
        f"the snapshot would be {len(body)} bytes, over the contract's {MAX_SNAPSHOT_BYTES}: "
        f"served complete: false without {len(snapshot.models) - len(fitted.models)} of its "
        f"{len(snapshot.models)} rows"
    )
    return fitted, encode_snapshot(fitted), why
