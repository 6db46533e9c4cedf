"""A segment truncated under running handlers (R-A15, R-G6).

Whoever may write the segment may also shrink it: a member of its group in
group-shared mode, or root's own tooling on a 0600 segment. An access past the new
end is a SIGBUS; the core's SIGBUS handler mends the pages of a registered mapping
with zeros (``_guard.h``), and the segment is then treated as one removed
by hand: said once, new arrivals go to what the name leads to (or are refused with
the reason). The handlers here are real processes (tests/agent.py) cycling short
slots; the truncation is a plain ``truncate(2)`` of the object in /dev/shm, by root
or by a process of another user in the segment's group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from gwtest import Agent, P1Segment, run_cli

from shm_layout import layout, platform

pytestmark = [
    pytest.mark.skipif(
        sys.platform == "darwin",
        reason="macOS cannot resize a shm object once sized (and has no /dev/shm path to it)",
    ),
    # the darwin test mode likewise: the attack does not exist on macOS (XNU's
    # pshm_truncate refuses a second size), so the mode has nothing to show here
    pytest.mark.linux("macOS cannot resize a shm object once sized: no truncation there"),
]

TRUNCATED = "was truncated while this process used it"


def _serve(p1: P1Segment, tmp_path: Path, *extra: str) -> tuple[Agent, Path, Path]:
    stop, mark = tmp_path / "stop", tmp_path / "mark"
    agent = p1.handler(
        "--gen",
        "serving",
        "--stop-file",
        str(stop),
        "--mark-file",
        str(mark),
        "--hold-ms",
        "10",
        *extra,
        "serve",
    )
    agent.expect("serving")
    return agent, stop, mark


def _end(agent: Agent, stop: Path) -> tuple[dict[str, object], str]:
    stop.touch()
    quiet = agent.expect("quiet")
    code = agent.finish()
    err = agent.proc.stderr.read() if agent.proc.stderr else ""
    assert code == 0, f"the handler died (exit {code}, SIGBUS is {-signal.SIGBUS}): {err}"
    return quiet, err


def _said_once(err: str) -> None:
    # in the darwin test mode the name check (a creation stamp there) may see it first
    lines = [x for x in err.splitlines() if TRUNCATED in x or "removed or replaced while" in x]
    assert len(lines) == 1, f"said {len(lines)} times: {err!r}"
    assert platform.is_darwin() or TRUNCATED in lines[0], err


def test_r_a15_a_handler_survives_its_segment_truncated_to_nothing_by_root(
    p1_segment: Callable[..., P1Segment], tmp_path: Path
) -> None:
    p1 = p1_segment(2)
    agent, stop, mark = _serve(p1, tmp_path)
    os.truncate(platform.SHM_DIR + p1.name, 0)
    mark.touch()
    agent.expect("after_mark", timeout=30)  # new arrivals: as for a removed segment
    quiet, err = _end(agent, stop)
    _said_once(err)
    assert quiet["slots_after_mark"] >= 1
    # the name leads to a whole segment again, made afresh (R-A9)
    assert os.stat(platform.SHM_DIR + p1.name).st_size >= layout.TOTAL_SIZE
    out = run_cli("inspect", "--segment", p1.name, "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_r_a15_a_segment_shrunk_to_one_page_refuses_arrivals_saying_why(
    p1_segment: Callable[..., P1Segment], tmp_path: Path
) -> None:
    p1 = p1_segment(2)
    agent, stop, _mark = _serve(p1, tmp_path)
    os.truncate(platform.SHM_DIR + p1.name, 4096)
    refused = agent.expect("refused", timeout=30)
    assert "truncated" in refused["reason"] and "4096 bytes" in refused["reason"]
    assert "--unlink --force" in refused["reason"]
    out = run_cli("inspect", "--segment", p1.name, "--check")
    text = (out.stdout + out.stderr).strip()
    assert out.returncode != 0 and "Traceback" not in text, text
    assert len(text.splitlines()) == 1 and "truncated" in text and "4096 bytes" in text, text
    quiet, err = _end(agent, stop)
    _said_once(err)
    assert quiet["reasons"] == [refused["reason"]]  # one reason, however often refused


def _as_group_member(gid: int, fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child of the user nobody whose groups are only ``gid``:
    a member of the segment's group, and no one else."""
    from gwtest import _nobody_ids

    uid, nobody_gid = _nobody_ids()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([gid])
            os.setgid(nobody_gid)
            os.setuid(uid)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_r_g6_a_group_member_truncating_the_segment_kills_no_handler(
    p1_segment: Callable[..., P1Segment], tmp_path: Path
) -> None:
    p1 = p1_segment(2)
    agent, stop, mark = _serve(p1, tmp_path, "--group-shared")
    path = platform.SHM_DIR + p1.name
    info = os.stat(path)
    assert info.st_mode & 0o777 == 0o660 and info.st_uid == 0
    _as_group_member(info.st_gid, lambda: os.truncate(path, 0))
    mark.touch()
    agent.expect("after_mark", timeout=30)
    quiet, err = _end(agent, stop)
    _said_once(err)
    assert quiet["slots_after_mark"] >= 1


def test_r_a15_a_sigbus_outside_every_segment_still_kills(tmp_path: Path) -> None:
    """The handler mends only the mappings it registered; any other SIGBUS goes to the
    disposition that was there before (here the default: the process dies of it)."""
    program = textwrap.dedent(
        f"""
        import mmap, os
        from shm_layout.segment import Segment
        seg = Segment.open({("/gwt-bus-" + os.urandom(4).hex())!r})  # the handler is in
        try:
            path = {str(tmp_path / "file")!r}
            with open(path, "wb") as f:
                f.write(bytes(mmap.PAGESIZE * 2))
            with open(path, "r+b") as f:
                m = mmap.mmap(f.fileno(), mmap.PAGESIZE * 2)
            os.truncate(path, 0)
        finally:
            from shm_layout.segment import unlink_segment
            seg.close()
            unlink_segment(seg.name)
        print("reading", flush=True)
        m[mmap.PAGESIZE]
        print("survived", flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == -signal.SIGBUS, out.stdout + out.stderr
    assert "reading" in out.stdout and "survived" not in out.stdout
