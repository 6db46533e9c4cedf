"""The drill's observer: what the segment and the upstream say, ten times a second.

It samples the provider's ``availability --json`` entry (the same document, built in
process), the holders by generation and the upstream's in-flight counts into
:class:`Sample` rows (``Drill.samples``, which the checks and the plot read), each
stamped when its read of the segment began, with how long that read took; every
three seconds, on a thread of its own, it asks the real CLI too, as an operator
would. Waiting above the queue bound (R-A2) is a problem the moment it is seen.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import TYPE_CHECKING

import httpx
from drill_records import DrillFailed, Sample

if TYPE_CHECKING:
    from drill_rig import Drill

QUEUE_BOUND = 32  # R-A2
CLI_EVERY_S = 3.0


def observe(drill: Drill) -> None:
    """Sample until ``drill.stop_sampling`` is set (run it in a thread of its own; it
    starts the CLI's own thread, :func:`check_cli`). A sample is stamped when its read of
    the segment begins, never after the upstream's answer that follows it."""
    cli = threading.Thread(target=check_cli, args=(drill,), daemon=True)
    cli.start()
    last_line = 0.0
    while not drill.stop_sampling.is_set():
        began = drill.now()
        got = drill.provider_doc()
        took = drill.now() - began
        try:
            stats = drill.upstream_stats()
        except (httpx.HTTPError, ValueError):
            stats = None
        if got is not None and stats is not None:
            p, view = got
            running: Counter[str] = Counter()
            waiting: Counter[str] = Counter()
            for h in view.holders:
                if h.provider == drill.provider and h.alive:
                    (running if h.state == "running" else waiting)[h.generation or "?"] += 1
            s = Sample(
                began,
                drill.phase,
                p["effective_limit"],
                p["source"],
                p["running"],
                p["waiting"],
                dict(running),
                dict(waiting),
                stats["inflight"]["admitted"],
                stats["inflight"]["legacy"],
                took,
            )
            drill.samples.append(s)
            if s.waiting > QUEUE_BOUND:
                drill.problems.append(f"waiting {s.waiting} > 32 at {s.t:.1f}s")
            if s.t - last_line >= 1.0:
                last_line = s.t
                gens = " ".join(f"{g} {n}" for g, n in sorted(running.items())) or "-"
                drill.say(
                    f"{drill.phase:<16} limit {s.limit:>2} ({s.source:<12}) running "
                    f"{s.running:>2} [{gens}]  waiting {s.waiting:>2}/32  upstream "
                    f"in flight {s.inflight:>2} (legacy {s.legacy_inflight})"
                )
        drill.stop_sampling.wait(0.1)
    cli.join(timeout=35)


def check_cli(drill: Drill) -> None:
    """Every ``CLI_EVERY_S``, the operator's own view, as a process: ``availability
    --json`` (on a thread of its own: a CLI slowed by load never delays a sample). It is
    given the time it needs; one still running when sampling stops is killed, and one
    past the CLI's time is counted (``cli_samples_unfinished``), not judged."""
    while not drill.stop_sampling.wait(CLI_EVERY_S):
        try:
            out = drill.cli(
                "availability", "--segment", drill.segment, "--json", stop=drill.stop_sampling
            )
        except DrillFailed:
            drill.cli_unfinished += 1
            continue
        if out.returncode == 0:
            drill.cli_checks += 1
            for p in json.loads(out.stdout)["providers"]:
                if p["id"] == drill.provider and p["waiting"] > QUEUE_BOUND:
                    drill.problems.append(f"availability --json: waiting {p['waiting']}")
