"""The upgrade drill's short form on real servers (R-A1, R-A2, R-G3, R-G4).

The drill itself checks every invariant and reports problems; this test runs
it as ``make drill`` does (shorter phases) and checks the summary's figures.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import threading
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


def test_r_a1_drill_check_judges_a_grant_from_the_last_read_ended_before_its_ask() -> None:
    """A sample is stamped when its read began and keeps how long the read took: one whose
    read began before a request was asked but ended after it may have read the limit
    after the ask, so the limit in force at the ask is judged from the last read that had
    ended by then. Here the limit was 20 until about 1.1 s, and the read begun at 1.0 s
    saw 10 at about 1.4 s: 15 requests asked and granted at 1.05 s, under 20, are no
    violation."""
    rises = [_arrive(n, n, 1.05, 1.05) for n in range(1, 16)]
    drill = _drill_with([(0.0, 20), (1.0, 10), (2.0, 10)])
    drill.samples[1].took = 0.5
    _check_inflight()(drill, rises)
    assert drill.problems == [], drill.problems
    # the same read over by 1.01 s: 10 was in force at the ask, and the same rise is one
    drill = _drill_with([(0.0, 20), (1.0, 10), (2.0, 10)])
    drill.samples[1].took = 0.01
    _check_inflight()(drill, rises)
    assert len(drill.problems) == 1 and "R-A1" in drill.problems[0], drill.problems
    # the evidence shows the samples around the newest grant, each as begun+took=limit
    assert "samples around the newest grant 0.000+0.000=20 1.000+0.010=10" in drill.problems[0]


def test_the_drill_observer_stamps_a_sample_when_its_read_of_the_segment_begins() -> None:
    """The upstream's answer comes after the segment's read and may be slow (up to 80 ms
    under load, 0.3 s here): the sample's time is the read's, not the answer's, and the
    CLI's every-3-s look runs on a thread of its own (a CLI slower than the whole run
    here does not hold a sample back)."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "drill"))
    from drill_observer import observe

    class Stub:
        provider = "p"
        phase = "p"
        segment = "/none"
        cli_checks = 0

        def __init__(self) -> None:
            self.t0 = time.monotonic()
            self.samples: list[Any] = []
            self.problems: list[str] = []
            self.stop_sampling = threading.Event()
            self.reads: list[float] = []

        def now(self) -> float:
            return time.monotonic() - self.t0

        def provider_doc(self) -> Any:
            self.reads.append(self.now())
            doc = {"effective_limit": 10, "source": "discovered", "running": 0, "waiting": 0}
            return doc, type("View", (), {"holders": []})()

        def upstream_stats(self) -> dict[str, Any]:
            time.sleep(0.3)
            return {"inflight": {"admitted": 0, "legacy": 0}}

        def cli(self, *args: str, stop: threading.Event | None = None) -> Any:
            self.stop_sampling.wait(10)  # the CLI on a loaded machine
            return subprocess.CompletedProcess(args, 1, "", "")

        def say(self, text: str) -> None:
            pass

    stub = Stub()
    thread = threading.Thread(target=observe, args=(stub,), daemon=True)
    thread.start()
    time.sleep(5.0)  # past the CLI's first look at 3 s
    stub.stop_sampling.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(stub.samples) >= 3
    for sample, read in zip(stub.samples, stub.reads, strict=False):
        assert sample.t <= read and sample.took < 0.25, (sample, read)
    times = [s.t for s in stub.samples]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[-1] > 3.5 and max(gaps) < 2.0, times  # sampling went on past the CLI's look


@pytest.mark.parametrize(("status", "waves"), [(200, 4), (429, 1)])
def test_the_drill_burst_sends_waves_until_one_of_its_requests_is_answered_429(
    status: int, waves: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst is for the overflow: while none of its requests was answered 429, another
    wave follows (a gateway that answers every request 200, as a loaded machine's spread
    arrivals let it, gets every wave); the first 429 ends it."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sys.path.insert(0, str(ROOT / "drill"))
    import drill_load
    from drill_records import Outcomes

    class Answer(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if status == 429:
                body = json.dumps({"error": {"code": "queue_full"}}).encode()
                self.send_response(429)
                self.send_header("Retry-After", "1")
            else:
                body = b"data: {}\n\n" * 3 + b"data: [DONE]\n\n"
                self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Stub:
        model_alias = "m"
        phase = "fenced w2"

        def __init__(self) -> None:
            self.outcomes = Outcomes()
            self.figures: dict[str, Any] = {}

    monkeypatch.setattr(drill_load, "BURST_WAVE_S", 0.3)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stub = Stub()
    try:
        drill_load.burst(stub, f"http://127.0.0.1:{server.server_address[1]}", 5)  # type: ignore[arg-type]
    finally:
        server.shutdown()
        server.server_close()
    assert stub.figures["burst_waves"] == waves
    answered = stub.outcomes.ok + stub.outcomes.rejected
    assert answered == 5 * waves and stub.outcomes.lost == 0, stub.outcomes


def test_a_failed_drill_keeps_its_evidence_whole(tmp_path: Path) -> None:
    """The scratch directory of a failed run (every process's log) stays, with the samples
    and the summary written beside them, and moves where ``--evidence`` says."""
    drill = _drill_with([(0.0, 20), (1.0, 10)])  # puts drill/ on the path
    from upgrade_drill import keep_evidence

    drill.tmp = tmp_path / "scratch"
    drill.tmp.mkdir()
    (drill.tmp / "gateway.log").write_text("provider local-inference unreachable\n")
    summary = {"ok": False, "problems": ["admitted 2 in the segment, 1 at the upstream"]}
    kept = keep_evidence(drill, summary, tmp_path / "evidence" / "run-1")
    assert kept == tmp_path / "evidence" / "run-1" and not drill.tmp.exists()
    assert (kept / "gateway.log").read_text() == "provider local-inference unreachable\n"
    assert [s[:3] for s in json.loads((kept / "samples.json").read_text())] == [
        [0.0, "p", 20],
        [1.0, "p", 10],
    ]
    assert json.loads((kept / "summary.json").read_text()) == summary
