"""The demo runs from the package alone and cleans up after itself (REQUIREMENTS.md section 11)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import psutil

EXE = str(Path(sys.executable).with_name("gateway-capacity"))
ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_demo(*extra: str) -> dict[str, object]:
    out = subprocess.run(
        [EXE, "demo", "--fast", "--json", *extra], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    schema = json.loads((ROOT / "docs" / "schemas" / "demo.schema.json").read_text())
    jsonschema.validate(summary, schema)  # schema_version and every field
    assert "advertised 20  limit 20 (discovered)" in out.stderr  # shown live
    assert "never above the limit in force" not in out.stderr  # it is, while they finish
    picture = summary["picture"]
    assert isinstance(picture, str), summary
    assert f"picture: {picture} (limit, advertised, running and waiting" in out.stderr
    return summary


def _check_png(path: Path) -> None:
    """A real PNG of a real size, outside the repository."""
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1100, 550), (width, height)
    assert len(data) > 20_000  # lines and text, not an empty canvas
    assert ROOT not in path.resolve().parents


def test_demo_shows_20_then_10_then_20_and_leaves_nothing_behind_twice_in_a_row(
    tmp_path: Path,
) -> None:
    for run in range(2):  # works when run twice in a row
        chosen = tmp_path / "demo.png"
        summary = _run_demo(*(["--png", str(chosen)] if run else []))
        picture = Path(str(summary["picture"]))
        try:
            _check_png(picture)
            if run:
                assert picture == chosen
            else:  # default: a new file in the temporary directory
                assert picture.parent == Path(tempfile.gettempdir())
                assert picture.name.startswith("gateway-capacity-demo-")
        finally:
            picture.unlink(missing_ok=True)
        assert summary["ok"] is True, summary["problems"]
        phases = summary["phases"]
        assert isinstance(phases, list)
        assert [p["expected_limit"] for p in phases] == [20, 10, 20, 20]
        assert [p["advertised_seen"] for p in phases] == [[20], [10], [20], [20]]
        # the classes phase: interactive requests admitted beside the batch flood (R-A18)
        loads = {load["generation"]: load for load in summary["load"]}  # type: ignore[union-attr]
        assert loads["interactive"]["admitted"] > 0
        assert loads["interactive"]["wait_p50_ms"] <= 500
        assert all(p["reached_after_s"] is not None for p in phases)
        assert phases[1]["limits_seen"][0] == 10  # drained to 10
        assert summary["peak_running"] == 20  # reached, never above
        assert 0 < int(summary["peak_waiting"]) <= 32  # type: ignore[call-overload]
        assert (summary["final_running"], summary["final_waiting"]) == (0, 0)
        assert summary["holder_records_left"] == 0
        assert summary["cleaned_up"] is True
        load = summary["load"]
        assert isinstance(load, list) and {g["generation"] for g in load} == {
            "handler-1.0",
            "handler-2.0",
            "interactive",
        }
        assert all(g["admitted"] > 0 for g in load)  # both generations drew on one budget
        segment = str(summary["segment"]).lstrip("/")
        assert segment.startswith("gwcap1-")
        if Path("/dev/shm").is_dir():  # the segment and every semaphore of it are gone
            assert not [p for p in Path("/dev/shm").iterdir() if segment in p.name]
    assert not [
        p
        for p in psutil.Process().children(recursive=True)
        if "gateway_capacity" in " ".join(p.cmdline())
    ]


def _summary_of(phases: list[dict[str, object]], problems: list[str]) -> str:
    from gateway_capacity.demo import _print_summary

    summary = {
        "phases": phases,
        "admitted": 90,
        "rejected": 0,
        "timeouts": 0,
        "peak_running": 20,
        "peak_waiting": 21,
        "load": [],
        "final_running": 0,
        "final_waiting": 0,
        "holder_records_left": 0,
        "cleaned_up": True,
        "problems": problems,
        "ok": not problems,
    }
    out = io.StringIO()
    _print_summary(summary, out)
    return out.getvalue()


def _phase(name: str, expect: int, peak: int, over: int) -> dict[str, object]:
    return {
        "name": name,
        "expected_limit": expect,
        "reached_after_s": 0.5,
        "limits_seen": sorted({20, expect}),
        "advertised_seen": [expect],
        "peak_running": peak,
        "peak_waiting": 21,
        "over_limit_running": over,
    }


def test_r_a1_summary_says_running_stayed_over_a_lowered_limit_while_earlier_ones_finished() -> (
    None
):
    """The live lines show `limit 10 running 15` after the drain (lowering cancels
    nothing); the summary says the same, not "never above the limit in force"."""
    phases = [
        _phase("two workers", 20, 20, 0),
        _phase("w2 drained (fenced)", 10, 20, 15),
        _phase("w2 restored", 20, 20, 0),
    ]
    text = _summary_of(phases, [])
    assert "never above" not in text
    assert "peak running 20 (at most the limit in force when each was admitted)" in text
    assert (
        "w2 drained (fenced): running 15 over the lowered limit 10 only while requests "
        "admitted before it finished"
    ) in text
    assert "two workers: running" not in text and "w2 restored: running" not in text
    # when running was seen rising above the limit, the summary does not claim it
    rose = _summary_of(phases, ["running rose to 16 above limit 10 at 8.1s"])
    assert "only while requests admitted before it finished" not in rose


def test_without_matplotlib_the_demo_says_so_instead_of_failing() -> None:
    """The picture step, run where ``import matplotlib`` fails as on a machine without it
    (``sys.modules[name] = None`` makes Python refuse the import)."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from gateway_capacity.demo import Phase, Sample, draw_picture\n"
        "ph = Phase('two workers', None, 20, 1.0)\n"
        "ph.samples.append(Sample(0.1, ph.name, 20, 20, 'discovered', 3, 0))\n"
        "print(draw_picture([ph], None))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        '(None, "picture: not drawn: matplotlib is not installed (pip install '
        "'gateway-capacity[plot]'; make demo installs it)\")"
    )


def test_a_segment_that_cannot_be_read_ends_the_demo_with_the_reason_not_silence() -> None:
    """Remove the demo's segment under it (as ``inspect --unlink --force`` would, by mistake):
    the demo says why and exits 1 within seconds, without a traceback, and cleans up."""
    proc = subprocess.Popen(
        [EXE, "demo", "--fast", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    segment = None
    try:
        while not any("advertised 20  limit 20" in x for x in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
            if segment is None and " segment /" in line:
                segment = line.rsplit(" segment ", 1)[1].strip()
        assert segment is not None, lines
        removed = subprocess.run(
            [EXE, "inspect", "--unlink", "--force", "--segment", segment],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert removed.returncode == 0, removed.stderr
        gone_at = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - gone_at
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    err = "".join(lines) + err
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err + out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is False
    problem = summary["problems"][0]
    assert problem.startswith(f"cannot read the segment {segment}: ") or problem.startswith(
        "the sidecar exited with status 1: "
    ), summary["problems"]
    assert f"PROBLEM: {problem}" in err
    assert took < 30, took  # said so, not waited out a phase (30 s) in silence
    if summary.get("picture"):
        os.unlink(summary["picture"])
    assert summary["cleaned_up"] is True
    assert not [
        p
        for p in psutil.Process().children(recursive=True)
        if "gateway_capacity" in " ".join(p.cmdline())
    ]


def _restored_phase() -> object:
    from gateway_capacity.demo import Phase, Sample

    ph = Phase("w2 restored", "unfence", 20, 1.0, reached_s=0.4)
    # the drained phase's limit and queue while the change reaches the segment, then 20
    for i, (limit, running, waiting) in enumerate(
        [(10, 10, 26), (10, 10, 25), (20, 20, 12), (20, 20, 4), (20, 20, 0)]
    ):
        ph.samples.append(Sample(10 + i * 0.2, ph.name, 20, limit, "discovered", running, waiting))
    return ph


def test_the_restored_row_shows_what_held_once_restored_and_the_changeover_apart() -> None:
    from gateway_capacity.demo import phase_summary

    row = phase_summary(_restored_phase())  # type: ignore[arg-type]
    assert (row["limits_seen"], row["peak_running"], row["peak_waiting"]) == ([20], 20, 12)
    assert row["changeover_limits_seen"] == [10] and row["changeover_peak_waiting"] == 26
    text = _summary_of([row], [])
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("w2 restored"))
    assert "-> limit [20] (reached 20 after 0.4s); peak running 20, peak waiting 12" in lines[at]
    assert lines[at + 1].strip() == "until then limit [10]: peak running 10, peak waiting 26"


def test_the_picture_shows_the_limit_where_running_reaches_it(tmp_path: Path) -> None:
    """Running sits on the limit at 20: the limit's band must still be seen around it."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    from gateway_capacity.demo import LIMIT_COLOR, RUNNING_COLOR, Phase, Sample, draw_picture

    ph = Phase("two workers", None, 20, 1.0)
    ph.samples.extend(Sample(t / 10, ph.name, None, 20, "discovered", 20, 0) for t in range(100))
    png, _ = draw_picture([ph], str(tmp_path / "p.png"))
    assert png is not None
    image = plt.imread(png)[:, :, :3]
    column = image[:, image.shape[1] // 2]  # a column through the middle of the plot

    def rows_near(color: tuple[float, ...], tolerance: float = 0.08) -> int:
        return int(
            sum(
                all(abs(a - b) < tolerance for a, b in zip(px, color, strict=True)) for px in column
            )
        )

    running = to_rgb(RUNNING_COLOR)
    band = tuple(0.35 * c + 0.65 * 1.0 for c in to_rgb(LIMIT_COLOR))  # alpha 0.35 on white
    assert rows_near(running) >= 1  # the running line is drawn
    assert rows_near(band) >= 2  # and the limit shows beside it, not hidden under it


def test_each_series_of_the_picture_has_a_colour_of_its_own(tmp_path: Path) -> None:
    """Running and interactive running are two lines: two colours, both drawn."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    from gateway_capacity import demo
    from gateway_capacity.demo import Phase, Sample, draw_picture

    names = ("LIMIT", "RUNNING", "ADVERTISED", "WAITING", "INTERACTIVE")
    colours = {to_rgb(getattr(demo, f"{n}_COLOR")) for n in names}
    assert len(colours) == len(names)
    ph = Phase("classes", None, 20, 1.0)
    ph.samples.extend(
        Sample(t / 10, ph.name, 20, 20, "discovered", 16, 8, interactive=4) for t in range(100)
    )
    png, _ = draw_picture([ph], str(tmp_path / "p.png"))
    assert png is not None
    image = plt.imread(png)[:, :, :3]
    for name in ("RUNNING", "INTERACTIVE"):
        colour = to_rgb(getattr(demo, f"{name}_COLOR"))
        near = (abs(image - colour) < 0.08).all(axis=2)
        assert near.sum() > 100, name  # its line (and legend entry) drawn in it


def test_the_summary_rows_line_up_and_say_what_the_brackets_hold() -> None:
    from gateway_capacity.demo import phase_summary

    short = phase_summary(_restored_phase())  # type: ignore[arg-type]
    long = dict(short, name="batch flood + interactive")
    lines = _summary_of([short, long], []).splitlines()
    rows = [line for line in lines if " advertised [" in line]
    assert len(rows) == 2
    assert len({row.index(" advertised [") for row in rows}) == 1, rows  # one column
    assert any("every value seen in the phase" in line for line in lines)
