"""The drill's observer: what the segment and the upstream say, ten times a second.

It samples the provider's ``availability --json`` entry (the same document, built in
process), the holders by generation and the upstream's in-flight counts into
:class:`Sample` rows (``Drill.samples``, which the checks and the plot read); every
three seconds it asks the real CLI too, as an operator would. Waiting above the queue
bound (R-A2) is a problem the moment it is seen.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import TYPE_CHECKING

import httpx
from drill_records import Sample

if TYPE_CHECKING:
    from drill_rig import Drill

QUEUE_BOUND = 32  # R-A2


def observe(drill: Drill) -> None:
    """Sample until ``drill.stop_sampling`` is set (run it in a thread of its own)."""
    last_cli = last_line = 0.0
    while not drill.stop_sampling.is_set():
        got = drill.provider_doc()
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
                drill.now(),
                drill.phase,
                p["effective_limit"],
                p["source"],
                p["running"],
                p["waiting"],
                dict(running),
                dict(waiting),
                stats["inflight"]["admitted"],
                stats["inflight"]["legacy"],
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
        if time.monotonic() - last_cli >= 3.0:  # the operator's own view, as a process
            last_cli = time.monotonic()
            out = drill.cli("availability", "--segment", drill.segment, "--json")
            if out.returncode == 0:
                drill.cli_checks += 1
                for p in json.loads(out.stdout)["providers"]:
                    if p["id"] == drill.provider and p["waiting"] > QUEUE_BOUND:
                        drill.problems.append(f"availability --json: waiting {p['waiting']}")
        drill.stop_sampling.wait(0.1)
