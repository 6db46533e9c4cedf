"""The drill's checks: what must hold when the load has stopped.

``final_checks`` runs them all: nothing left behind in the segment, nothing lost
(the segment's counters, the upstream's totals and the clients' answers agree
exactly), the queue bound (R-A2), R-A1 at the upstream judged by each request's
grant (:func:`check_inflight`) and in the observer's samples (:func:`check_running`),
a clean stop of the gateway and the sidecar, and the key in no log (R-P7). Each
failure is a line in ``drill.problems``; the figures go to ``drill.figures``.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
from typing import TYPE_CHECKING, Any

from drill_records import GEN_A, GEN_B

if TYPE_CHECKING:
    from drill_rig import Drill


def final_checks(drill: Drill, sidecar: subprocess.Popen[bytes]) -> None:
    """After the load: nothing left behind, nothing lost (the segment, the upstream and the
    clients agree exactly), R-A1 and R-A2 held; then the gateway and the sidecar stop
    cleanly and the key was never logged. Figures for the summary go to ``drill.figures``."""
    inspect = json.loads(drill.cli("inspect", "--segment", drill.segment, "--json").stdout)
    p = next(x for x in inspect["providers"] if x["id"] == drill.provider)
    left = [h for h in inspect["holders"]]
    if p["running"] or p["waiting"] or left:
        drill.problems.append(
            f"left behind: running {p['running']}, waiting "
            f"{p['waiting']}, holder records {len(left)}"
        )
    counters = p["counters"]
    stats = drill.upstream_stats()
    events = drill.http.get(f"{drill.upstream_url}/_drill/events").json()
    (drill.tmp / "upstream-events.json").write_text(json.dumps(events))  # the evidence
    o = drill.outcomes
    # nothing lost: the segment, the upstream and the clients agree exactly
    if counters["admitted_total"] != stats["total"]["admitted"]:
        drill.problems.append(
            f"admitted {counters['admitted_total']} in the segment, "
            f"{stats['total']['admitted']} at the upstream"
        )
    if stats["total"]["admitted"] != o.ok or stats["completed"]["admitted"] != o.ok:
        drill.problems.append(
            f"upstream saw {stats['total']['admitted']} admitted "
            f"requests, clients got {o.ok} whole answers"
        )
    if counters["rejected_total"] != o.rejected:
        drill.problems.append(
            f"rejected {counters['rejected_total']} in the segment, "
            f"{o.rejected} 429s at the clients"
        )
    if o.lost:
        drill.problems.append(f"requests lost or failed: {dict(o.errors)}")
    if counters["peak_waiting"] > 32:
        drill.problems.append(f"peak waiting {counters['peak_waiting']} > 32")
    if counters["peak_running"] > 20:
        drill.problems.append(f"peak running {counters['peak_running']} > 20")
    if o.rejected == 0:
        drill.problems.append("no overflow was answered 429 (the drill must provoke it)")
    check_inflight(drill, events)
    check_running(drill)
    # stop the gateway: its workers' lifespan shutdown detaches them
    master = drill.procs["gateway"]
    master.send_signal(signal.SIGTERM)
    code = master.wait(timeout=60)
    if code != 0:
        drill.problems.append(f"gunicorn exited {code}")
    view = drill.provider_doc()
    members = [] if view is None else [m for m in view[1].members if m.alive]
    if members:
        drill.problems.append(f"{len(members)} handler processes still registered")
    sidecar.send_signal(signal.SIGTERM)
    if sidecar.wait(timeout=30) != 0:
        drill.problems.append("the sidecar did not exit 0 on SIGTERM")
    check_key_never_logged(drill)
    drill.figures.update(
        {
            "admitted": counters["admitted_total"],
            "rejected": counters["rejected_total"],
            "timeouts": counters["timeouts_total"],
            "cancelled": counters["cancelled_total"],
            "peak_running": counters["peak_running"],
            "peak_waiting": counters["peak_waiting"],
            "upstream_peak_inflight": stats["peak"]["admitted"],
            "legacy_requests": stats["total"]["legacy"],
            "legacy_ok": o.legacy_ok,
            "client_ok": o.ok,
            "client_429": o.rejected,
            "lost": o.lost,
            "dropped_by_reload_before_admission": sum(o.dropped_by_reload.values()),
            "final_running": p["running"],
            "final_waiting": p["waiting"],
            "holder_records_left": len(left),
            "registered_after_stop": len(members),
            "samples": len(drill.samples),
            "cli_samples": drill.cli_checks,
            "cli_samples_unfinished": drill.cli_unfinished,
        }
    )


def check_inflight(drill: Drill, events: list[list[Any]]) -> None:
    """R-A1 at the upstream, exactly, from its log of in-flight changes and the grants.

    Each admitted request reaches the upstream with its grant (the middleware's
    ``x-gateway-capacity-grant``: when it arrived and when it was admitted, on the
    host's monotonic clock; its slot was granted at some instant of that interval).
    At a rise to ``v``, the ``v`` requests in flight all hold slots; the one granted
    last was granted while the others already ran, so R-A1 says ``v`` is at most the
    limit in force at that grant. Which one was last is not known, so the check is
    that ``v`` is within the highest limit in force during any of their
    [asked, granted] intervals. The limit in force over an interval is read from the
    observer's samples: from the last one whose read had ended before it was asked to
    the first one whose read began after it was granted (a sample is stamped when its
    read begins and keeps how long it took; a change between two samples shows in the
    next one). Load delays the request on its way to the upstream, but does not move
    the time it is judged at.
    """
    import bisect

    samples = drill.samples
    begun = [s.t for s in samples]
    ended = [s.read_by for s in samples]
    if not samples:
        drill.problems.append("no samples")
        return

    def highest_limit(start: float, end: float) -> int:
        lo = max(bisect.bisect_right(ended, start) - 1, 0)
        hi = min(bisect.bisect_left(begun, end) + 1, len(samples))
        return max(s.limit for s in samples[lo:hi])

    in_flight: dict[int, tuple[float, float]] = {}
    rises = previous = 0
    for _, kind, value, request, asked, granted in events:
        if kind != "admitted":
            continue
        rising, previous = value > previous, value
        if not rising:
            in_flight.pop(request, None)
            continue
        if asked is None or granted is None:
            drill.problems.append(
                f"admitted request {request} reached the upstream ungranted (no grant header)"
            )
            return
        in_flight[request] = (asked - drill.t0, granted - drill.t0)
        rises += 1
        allowed = max(highest_limit(a, g) for a, g in in_flight.values())
        if value > allowed:
            newest = max(g for _, g in in_flight.values())
            drill.problems.append(
                f"upstream in flight rose to {value} above the limit in force at its "
                f"grants ({allowed}), newest grant at {newest:.2f}s (R-A1); "
                + _rise_evidence(drill, in_flight)
            )
            return
    drill.figures["upstream_rises_checked"] = rises


def _rise_evidence(drill: Drill, in_flight: dict[int, tuple[float, float]]) -> str:
    """What a failed rise was judged on, for the one reading the failure: each request in
    flight as asked..granted (drill seconds); the limit samples from just before the
    earliest ask on (each change of limit, with the time its read began); the samples
    around the newest grant, each as begun+took=limit; and the gateway log's worker
    deaths (a worker gunicorn kills frees its slots while the upstream still counts its
    requests until it notices the closed connection)."""
    import bisect

    samples = drill.samples
    begun = [s.t for s in samples]
    spans = sorted(in_flight.values(), key=lambda span: span[1])
    # from the sample before the one the earliest ask was judged by
    start = max(bisect.bisect_left(begun, min(a for a, _ in spans)) - 2, 0)
    shown: list[str] = []
    for s in samples[start:]:
        if not shown or not shown[-1].endswith(f"={s.limit}"):
            shown.append(f"{s.t:.2f}={s.limit}")
    newest = bisect.bisect_left(begun, spans[-1][1])
    around = " ".join(
        f"{s.t:.3f}+{s.took:.3f}={s.limit}" for s in samples[max(newest - 3, 0) : newest + 3]
    )
    log = drill.log_of("gateway")
    deaths = sum(log.count(word) for word in ("WORKER TIMEOUT", "was sent SIGKILL", "died"))
    return (
        "in flight "
        + " ".join(f"{a:.2f}..{g:.2f}" for a, g in spans)
        + "; limit samples "
        + " ".join(shown[:20])
        + f"; samples around the newest grant {around}"
        + f"; gateway log worker deaths {deaths}"
    )


def check_key_never_logged(drill: Drill) -> None:
    """R-P7: the provider's key reaches the upstream, but no log of any process."""
    key = drill.key_file.read_text().strip()
    leaked = [p.name for p in drill.tmp.glob("*.log") if key in p.read_text(errors="replace")]
    if leaked:
        drill.problems.append(f"the provider key appears in: {', '.join(sorted(leaked))}")


def check_running(drill: Drill) -> None:
    """Running rises only within the limit in force (R-A1): above it, it may only go down.

    Between two samples either sample's limit may have been in force when the rise
    happened, so a rise is checked against the higher of the two.
    """
    for prev, cur in itertools.pairwise(drill.samples):
        if cur.running > prev.running and cur.running > max(prev.limit, cur.limit):
            drill.problems.append(
                f"running rose to {cur.running} above limit {cur.limit} at {cur.t:.1f}s"
            )
            return
    overlap = [
        s for s in drill.samples if s.by_generation.get(GEN_A, 0) and s.by_generation.get(GEN_B, 0)
    ]
    drill.figures["overlap_samples_A_and_B_running"] = len(overlap)
    drill.figures["peak_inflight_by_phase"] = {
        ph: max(s.inflight for s in drill.samples if s.phase == ph)
        for ph in dict.fromkeys(s.phase for s in drill.samples)
    }
    drill.figures["limits_by_phase"] = {
        ph: sorted({s.limit for s in drill.samples if s.phase == ph})
        for ph in dict.fromkeys(s.phase for s in drill.samples)
    }
