"""A test session owns what it starts, however it ends (tests/owned.py): a pytest run
killed outright leaves nothing running, real processes and real SIGKILLs.

Each test runs pytest on this file's probe (defined only when ``GWCAP_OWNED_PROBE``
names a file): it starts, each in a session of its own (out of reach of a kill of
the run's process group), a process, a shell with two children, and a server; writes
their pids and its own, and sleeps. The test then
kills some of the run with SIGKILL and watches the probe's processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import owned
import pytest
from gwtest import wait_until

ROOT = Path(__file__).resolve().parents[2]
PROBE_ENV = "GWCAP_OWNED_PROBE"
PROBE = "tests/repo/test_owned.py::test_probe_starts_processes_and_sleeps"

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc"),
    # a pytest run's start took up to 2 minutes on the 2-core machine at load 30
    pytest.mark.timeout(600),
]

if os.environ.get(PROBE_ENV):

    def test_probe_starts_processes_and_sleeps() -> None:
        alone = subprocess.Popen(["sleep", "600"], start_new_session=True)
        shell = subprocess.Popen(
            ["bash", "-c", "sleep 600 & sleep 600 & wait"], start_new_session=True
        )
        server = subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until(lambda: len(_children(shell.pid)) == 2, timeout=30)
        pids = [alone.pid, shell.pid, *_children(shell.pid), server.pid]
        doc = {"pids": pids, "pytest": os.getpid(), "token": os.environ.get(owned.OWNER_ENV, "")}
        Path(os.environ[PROBE_ENV] + ".part").write_text(json.dumps(doc))
        os.rename(os.environ[PROBE_ENV] + ".part", os.environ[PROBE_ENV])
        time.sleep(600)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        return [int(p) for p in path.read_text().split()]
    return []


def _alive(pid: int) -> bool:
    """Running, not a zombie its parent has yet to reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _reapers(token: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if p.name.isdigit() and f"--reap\0{token}\0" in (p / "cmdline").read_text():
                found.append(int(p.name))
    return found


def _probe_run(tmp_path: Path, *options: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """pytest on the probe (``options``: ``-n 1`` or ``-n 0``), in a session of its own;
    it and the probe's document once the probe has started everything. (With ``-n 1``,
    ``--max-worker-restart 0``: a worker that replaced the killed one would run the probe
    again, and its processes are no test's to watch.)"""
    where = tmp_path / "probe.json"
    env = {**os.environ, PROBE_ENV: str(where)}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, PROBE],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert wait_until(where.exists, timeout=240), "the probe did not start"
    return run, json.loads(where.read_text())


def _end(run: subprocess.Popen[bytes], doc: dict[str, Any]) -> None:
    """Whatever a test left of the run: its group, then the probe's processes."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    for pid in [*doc["pids"], *_reapers(doc["token"])]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("killed", ["worker", "controller"])
def test_a_pytest_worker_or_its_controller_killed_outright_leaves_nothing_running(
    tmp_path: Path, killed: str
) -> None:
    """SIGKILL of the xdist worker that runs the test, or of the controller alone (its
    worker would go on with the test it runs: the controller's reaper kills it, and the
    worker's reaper what the test started)."""
    run, doc = _probe_run(tmp_path, "-n", "1", "--max-worker-restart", "0")
    try:
        assert all(_alive(pid) for pid in doc["pids"])
        os.kill(doc["pytest"] if killed == "worker" else run.pid, signal.SIGKILL)
        gone = wait_until(lambda: not any(_alive(pid) for pid in doc["pids"]), timeout=30)
        assert gone, [pid for pid in doc["pids"] if _alive(pid)]
        assert not _alive(doc["pytest"])
        assert wait_until(lambda: not _reapers(doc["token"]), timeout=10)  # it exited too
    finally:
        _end(run, doc)


def test_a_pytest_run_killed_as_a_group_leaves_nothing_running(tmp_path: Path) -> None:
    run, doc = _probe_run(tmp_path, "-n", "0")
    try:
        os.killpg(run.pid, signal.SIGKILL)  # the whole run's process group at once
        gone = wait_until(lambda: not any(_alive(pid) for pid in doc["pids"]), timeout=30)
        assert gone, [pid for pid in doc["pids"] if _alive(pid)]
    finally:
        _end(run, doc)


def test_what_a_run_killed_with_its_reaper_left_is_killed_by_the_next_session(
    tmp_path: Path,
) -> None:
    run, doc = _probe_run(tmp_path, "-n", "0")
    try:
        for pid in _reapers(doc["token"]):
            os.kill(pid, signal.SIGKILL)
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        assert not _reapers(doc["token"])  # nobody left to sweep them but the next session
        # the next session, at its start, kills what carries the token of a run that is gone
        # (any session with this conftest: one that starts meanwhile may be first)
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", __file__],
            cwd=ROOT,
            capture_output=True,
            timeout=240,
        )
        gone = wait_until(lambda: not any(_alive(pid) for pid in doc["pids"]), timeout=10)
        assert gone, [pid for pid in doc["pids"] if _alive(pid)]
    finally:
        _end(run, doc)
