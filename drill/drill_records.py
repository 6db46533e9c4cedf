"""What the drill records, in one home below the modules that fill and read it: the
generations' names, the observer's :class:`Sample` rows and the load's
:class:`Outcomes` (``drill_rig.Drill`` holds them; ``drill_observer`` and
``drill_load`` write them; ``drill_checks`` and ``drill_plot`` read them), and
:class:`DrillFailed`, how a step that could not go on says why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

GEN_A, GEN_B = "gen-A", "gen-B"


class DrillFailed(Exception):
    """A step of the drill could not go on; its text is the problem the summary reports."""


@dataclass
class Sample:
    """One reading of the segment (and then of the upstream's counts). ``t`` is when the
    segment's read began (drill seconds) and ``took`` how long it lasted: the limit,
    running and waiting it holds were in the segment at some instant of
    ``[t, t + took]``."""

    t: float
    phase: str
    limit: int
    source: str
    running: int
    waiting: int
    by_generation: dict[str, int]
    waiting_by_generation: dict[str, int]
    inflight: int
    legacy_inflight: int
    took: float = 0.0

    @property
    def read_by(self) -> float:
        """When the segment's read had ended."""
        return self.t + self.took


@dataclass
class Outcomes:
    ok: int = 0
    rejected: int = 0
    timed_out: int = 0
    bad_429: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    legacy_ok: int = 0
    # Connections a stopping gunicorn worker closed before it read the request (the
    # reload's accept race: uvicorn closes connections that have sent nothing yet when
    # it shuts down). Not lost to admission: the exact accounting (segment admitted =
    # upstream = whole answers) proves none of them was admitted; reported apart.
    dropped_by_reload: Counter[str] = field(default_factory=Counter)

    @property
    def lost(self) -> int:
        return sum(self.errors.values())
