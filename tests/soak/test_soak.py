"""The chaos soak's short form: ``make soak`` runs the long one.

Real processes throughout (``tests/soak/soak.py``): handler workers of two
generations, the sidecar, a flipping capacity router and a counting upstream on
127.0.0.1, SIGKILLs of workers (some aimed at the lock holder) and of the sidecar,
and config edits. The soak checks R-A1/R-A2/R-A5/R-A6 and the counters itself and
exits 1 on any violation; these tests hold it to that and to having really done
the chaos, and show that its R-A1 check can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SOAK = Path(__file__).with_name("soak.py")


def run_soak(tmp_path: Path, *args: str, timeout: float = 110) -> tuple[int, dict[str, Any], str]:
    report = tmp_path / "soak.json"
    proc = subprocess.Popen(
        [sys.executable, str(SOAK), "--json", str(report), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the soak stops its processes and removes its segment
        _, err = proc.communicate(timeout=60)
        raise AssertionError(f"the soak did not end within {timeout} s: {err[-2000:]}") from None
    doc: dict[str, Any] = json.loads(report.read_text()) if report.exists() else {}
    return proc.returncode, doc, err


def test_r_a1_r_a2_r_a5_short_soak_loses_nothing_under_kills_and_bad_answers(
    tmp_path: Path,
) -> None:
    code, rep, err = run_soak(tmp_path, "--seconds", "20", "--workers", "8", "--hammers", "2")
    assert rep, f"the soak wrote no report: {err[-2000:]}"
    assert rep["violations"] == [], json.dumps(rep["diagnostics"], indent=1)
    assert rep["lost"] == []
    assert code == 0, err[-2000:]
    # the chaos really happened, and the checks really ran
    kills = rep["kills_survived"]
    assert sum(kills["workers"].values()) >= 5, kills
    assert kills["sidecar"] >= 1, kills
    assert rep["bad_answers_served"] >= 1
    assert sum(rep["config_edits"].values()) >= 1
    assert rep["operations"]["upstream_answered"] > 0
    verified = rep["r_a1_claims"]["verified"]
    assert verified.get("requests in flight at the upstream", 0) > 0, verified
    assert verified.get("RUNNING records", 0) > 0, verified
    assert rep["checks"]["counters vs records"] > 0
    assert rep["reclaim"]["timed"] > 0


def test_r_a1_soak_check_fails_when_told_the_limits_were_lower(tmp_path: Path) -> None:
    # The checker's self-test: every sampled limit taken as one lower than it was.
    # Real admissions up to the real limit must then be reported as R-A1 violations.
    code, rep, err = run_soak(
        tmp_path, "--seconds", "8", "--workers", "4", "--hammers", "0", "--understate", "1"
    )
    assert code == 1, err[-2000:]
    assert rep["r_a1_violations"] > 0
    assert any(v.startswith("R-A1:") for v in rep["violations"])
