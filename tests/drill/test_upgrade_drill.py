"""The upgrade drill's short form on real servers (issue 12 section 2; R-A1, R-A2, R-G3, R-G4).

The drill itself checks every invariant and reports problems; this test runs
it as ``make drill`` does (shorter phases) and checks the summary's figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
