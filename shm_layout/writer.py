"""The single writer of limits: fencing epochs, publication and heartbeat (R-G4, R-L7, R-L9).

A sidecar takes the next ``writer_epoch`` under the lock when it starts.
Every later write re-checks, under the same lock, that the header still
carries its epoch; a sidecar that finds a newer one raises
:class:`Superseded` and has written nothing. So a retired sidecar can never
put an older configuration or limit back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shm_layout import layout, ledger
from shm_layout.layout import SOURCE_CODES, H, P, R
from shm_layout.segment import Segment
from shm_layout.view import ReplicaView

ReplicaRecord = ReplicaView  # a replica is written with the fields it is read with


class Superseded(Exception):
    """A newer sidecar took the writer epoch."""

    def __init__(self, mine: int, current: int) -> None:
        self.mine = mine
        self.current = current
        super().__init__(f"writer epoch {mine} was superseded by epoch {current}")


@dataclass(frozen=True, slots=True)
class Publication:
    """One provider's row as the sidecar wants it after a refresh.

    ``limit`` is None when nothing is to be enforced beyond the fallback
    (static providers, failed discovery): handlers then use ``fallback``.
    """

    provider_id: str
    discovery: bool
    fallback: int
    fallback_source: str
    limit: int | None = None
    source: str = "discovered"
    reason: str = ""
    discovered: int | None = None
    observed_at: float | None = None
    expires_at: float | None = None
    replicas: Sequence[ReplicaRecord] = field(default=())


def take_epoch(
    seg: Segment, pid: int, start: float, now: float, refresh_s: float, config_path: str
) -> int:
    with seg.lock:
        buf = seg.buf
        epoch: int = H["writer_epoch"].get(buf) + 1
        H["writer_epoch"].put(buf, epoch)
        H["sidecar_start"].put(buf, start)
        H["sidecar_pid"].put(buf, pid)
        H["sidecar_state"].put(buf, layout.SIDECAR_RUNNING)
        H["heartbeat"].put(buf, now)
        H["refresh_s"].put(buf, refresh_s)
        H["config_path"].put(buf, layout.encode_text(config_path, 256))
    return epoch


def _check(seg: Segment, epoch: int) -> None:
    current = H["writer_epoch"].get(seg.buf)
    if current != epoch:
        raise Superseded(epoch, current)


def heartbeat(seg: Segment, epoch: int, now: float, legacy_alive: int = 0) -> int:
    """Mark the sidecar alive, reap dead holders and grant what expiries allow (R-A5, R-L7).

    Returns how many holder records were reclaimed.
    """
    with seg.lock:
        _check(seg, epoch)
        H["heartbeat"].put(seg.buf, now)
        H["legacy_alive"].put(seg.buf, legacy_alive)
        reclaimed, rings = ledger.reap(seg.buf, now)
    seg.ring(rings)
    return reclaimed


def set_state(seg: Segment, epoch: int, state: int) -> None:
    """Record how the sidecar left (stopped / retired); only the holder of ``epoch`` may."""
    with seg.lock:
        if H["writer_epoch"].get(seg.buf) == epoch:
            H["sidecar_state"].put(seg.buf, state)


def publish(
    seg: Segment,
    epoch: int,
    config_generation: int,
    config_status: str,
    publications: Sequence[Publication],
    now: float,
) -> list[str]:
    """Write every provider's row, then grant waiters the new limits allow.

    Providers in the segment but absent from ``publications`` (removed from
    the config) are marked unconfigured and fall back to their stored
    fallback. Returns warnings (clamped static limits) for the caller to log.
    """
    warnings: list[str] = []
    with seg.lock:
        _check(seg, epoch)
        buf = seg.buf
        H["config_generation"].put(buf, config_generation)
        H["config_status"].put(buf, layout.encode_text(config_status, layout.REASON_BYTES))
        seen: set[int] = set()
        for pub in publications:
            try:
                p, _ = ledger.ensure_provider(
                    buf, pub.provider_id, pub.fallback, pub.fallback_source, pub.discovery
                )
            except ledger.TableFull as exc:
                warnings.append(f"provider {pub.provider_id}: not published: {exc}")
                continue
            seen.add(p)
            if ledger.set_fallback(buf, p, pub.fallback, pub.fallback_source, pub.discovery):
                warnings.append(
                    f"provider {pub.provider_id}: configured limit {pub.fallback} is above the "
                    f"segment's room of {layout.RUNNING_ROOM} running; clamped"
                )
            _write_publication(buf, p, pub, epoch, now)
        for p in range(layout.PROVIDER_COUNT):
            base = ledger.provider_base(p)
            if not P["in_use"].get(buf, base):
                break
            if p not in seen:
                P["flags"].put(buf, P["flags"].get(buf, base) & ~layout.PFLAG_CONFIGURED, base)
                P["published_limit"].put(buf, -1, base)
                for name in ("observed_at", "expires_at"):
                    P[name].put(buf, 0.0, base)
                P["discovered"].put(buf, -1, base)
                P["replica_count"].put(buf, 0, base)
                P["reason"].put(
                    buf, layout.encode_text("not in the config any more", layout.REASON_BYTES), base
                )
        rings = ledger.pump_all(buf, now)
    seg.ring(rings)
    return warnings


def _write_publication(buf: ledger.Buf, p: int, pub: Publication, epoch: int, now: float) -> None:
    base = ledger.provider_base(p)
    # Fields first, the limit last: a lock-free reader sees old or new, never a mix that
    # pairs a new limit with an old expiry.
    P["published_source"].put(buf, SOURCE_CODES.get(pub.source, SOURCE_CODES["discovered"]), base)
    P["published_at"].put(buf, now, base)
    P["observed_at"].put(buf, pub.observed_at or 0.0, base)
    P["expires_at"].put(buf, pub.expires_at or 0.0, base)
    P["published_epoch"].put(buf, epoch, base)
    P["discovered"].put(buf, -1 if pub.discovered is None else pub.discovered, base)
    P["reason"].put(buf, layout.encode_text(pub.reason, layout.REASON_BYTES), base)
    replicas = list(pub.replicas)[: layout.REPLICA_COUNT]
    for r, rep in enumerate(replicas):
        rb = base + layout.REPLICA_BASE + r * layout.REPLICA_ROW_SIZE
        R["address"].put(buf, layout.encode_text(rep.address, 48), rb)
        R["ok"].put(buf, int(rep.ok), rb)
        R["complete"].put(buf, int(rep.complete), rb)
        R["value"].put(buf, -1 if rep.value is None else rep.value, rb)
        R["observed_at"].put(buf, rep.observed_at or 0.0, rb)
        R["reason"].put(buf, layout.encode_text(rep.reason, 64), rb)
    P["replica_count"].put(buf, len(replicas), base)
    limit = -1 if pub.limit is None or pub.expires_at is None else max(pub.limit, 0)
    P["published_limit"].put(buf, limit, base)
