"""The upgrade drill's short form on real servers (R-A1, R-A2, R-G3, R-G4).

The drill itself checks every invariant and reports problems; this test runs
it as ``make drill`` does (shorter phases) and checks the summary's figures.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(420)
def test_upgrade_drill_short_form_keeps_one_budget_across_generations(tmp_path: Path) -> None:
    png = tmp_path / "drill.png"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "drill" / "upgrade_drill.py"),
            "--short",
            "--json",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=str(tmp_path),
    )
    assert out.stdout.strip(), out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True, (summary["problems"], out.stderr[-4000:])
    assert out.returncode == 0
    # R-G3: nothing admitted while the legacy generation lived; then the discovered budget
    assert summary["peak_inflight_by_phase"]["legacy"] == 0
    assert summary["legacy_ok"] == summary["legacy_requests"] > 0
    # R-G4: the fenced sidecar retired with exit 0
    assert summary["old_sidecar_exit"] == 0
    # the router's fence and unfence reached the limit in force: 20 -> 10 -> 20
    assert 10 in summary["limits_by_phase"]["fenced w2"]
    assert summary["limits_by_phase"]["HUP -> gen-B"] == [20]
    # R-A1 / R-A2 across generations, overflow answered 429, nothing lost
    assert summary["upstream_peak_inflight"] <= 20 and summary["peak_running"] <= 20
    assert summary["peak_waiting"] <= 32
    assert summary["client_429"] == summary["rejected"] > 0
    assert summary["client_ok"] == summary["admitted"] > 0
    # R-A1 judged exactly: every admitted arrival at the upstream, by its grant
    assert summary["upstream_rises_checked"] == summary["admitted"]
    assert summary["lost"] == 0 and summary["timeouts"] == 0
    assert (summary["final_running"], summary["final_waiting"]) == (0, 0)
    assert summary["holder_records_left"] == 0 and summary["registered_after_stop"] == 0
    assert summary["cleaned_up"] is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [
        p
        for p in psutil.Process().children(recursive=True)
        if any(x in " ".join(p.cmdline()) for x in ("gunicorn", "fake_upstream", "simworkers"))
    ]


def _drill_with(samples: list[tuple[float, int]]) -> Any:
    """A Drill whose observer saw these (time, limit) samples; nothing is started."""
    sys.path.insert(0, str(ROOT / "drill"))
    import io

    from upgrade_drill import Drill, Sample

    drill = Drill(short=True, out=io.StringIO())
    shutil.rmtree(drill.tmp)  # nothing runs: its scratch directory is not needed
    drill.t0 = 1000.0
    drill.samples = [Sample(t, "p", lim, "discovered", 0, 0, {}, {}, 0, 0) for t, lim in samples]
    return drill


def _check_inflight() -> Any:
    """drill_checks.check_inflight, the check of R-A1 at the upstream by each grant."""
    sys.path.insert(0, str(ROOT / "drill"))
    from drill_checks import check_inflight

    return check_inflight


def _arrive(n: int, request: int, asked: float, granted: float) -> list[object]:
    return [0.0, "admitted", n, request, 1000.0 + asked, 1000.0 + granted]


def _leave(n: int, request: int) -> list[object]:
    return [0.0, "admitted", n, request, None, None]


def test_r_a1_drill_check_judges_each_rise_by_the_limit_in_force_at_its_grants() -> None:
    """The exact check: a request granted under limit 3 that reaches the upstream late,
    after the limit fell to 2, is no violation (a check by the upstream's arrival time
    would fail here under load); three in flight that were all granted under limit 2 is
    one."""
    samples = [(0.0, 3), (1.0, 3), (2.0, 2), (3.0, 2), (4.0, 2)]
    late = [_arrive(1, 1, 0.1, 0.1), _arrive(2, 2, 0.2, 0.2), _arrive(3, 3, 0.9, 0.95)]
    drill = _drill_with(samples)
    check_inflight = _check_inflight()
    check_inflight(drill, late)
    assert drill.problems == [], drill.problems
    assert drill.figures["upstream_rises_checked"] == 3
    broken = [
        _arrive(1, 1, 2.5, 2.5),
        _arrive(2, 2, 2.6, 2.6),
        _leave(1, 1),
        _arrive(2, 3, 3.1, 3.2),
        _arrive(3, 4, 3.3, 3.4),  # 3 in flight, every grant under limit 2: R-A1 broke
    ]
    drill = _drill_with(samples)
    check_inflight(drill, broken)
    assert len(drill.problems) == 1 and "R-A1" in drill.problems[0]
    # the failure carries what it was judged on: the spans in flight and the limit's changes
    assert "in flight 2.60..2.60 3.10..3.20 3.30..3.40" in drill.problems[0], drill.problems
    assert "limit samples 1.00=3 2.00=2;" in drill.problems[0], drill.problems
    drill = _drill_with(samples)
    check_inflight(drill, [[0.0, "admitted", 1, 1, None, None]])
    assert "ungranted" in drill.problems[0]
