"""What the sidecar does for systemd, with real processes: SIGHUP re-reads the
config (``systemctl reload``), ``STATUS=`` carries the limits, and the
``--await-legacy`` drain neither stops on a pid that /proc hides nor starts
on a pidfile path that does not exist."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sidecar_e2e import (
    EXE,
    STATIC,
    Rig,
    SidecarProc,
    StartSidecar,
    clean_env,
    discovered,
    run_sidecar,
    wait_provider,
)


def _wait_log(proc: SidecarProc, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log_text():
        assert proc.poll() is None, f"sidecar exited {proc.poll()}:\n{proc.log_text()}"
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{proc.log_text()}"
        time.sleep(0.05)


def test_sighup_rereads_the_config_and_never_kills_the_sidecar(rig: Rig) -> None:
    config = rig.write_config({"maxConcurrent": 8, "providers": [{"id": "p", "maxConcurrent": 3}]})
    sidecar = rig.start(config)
    rig.wait("p", lambda p: p["effective_limit"] == 3)
    sidecar.signal(signal.SIGHUP)  # nothing changed: still alive, nothing redone
    _wait_log(sidecar, "received SIGHUP")
    _wait_log(sidecar, "config unchanged")
    rig.write_config({"maxConcurrent": 8, "providers": [{"id": "p", "maxConcurrent": 5}]})
    sidecar.signal(signal.SIGHUP)
    rig.wait("p", lambda p: p["effective_limit"] == 5, what="reloaded")
    for _ in range(3):  # a burst of reloads
        sidecar.signal(signal.SIGHUP)
    time.sleep(0.5)
    assert sidecar.poll() is None, sidecar.log_text()
    assert sidecar.log_text().count("received SIGHUP") >= 2
    assert "Traceback" not in sidecar.log_text()
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(10) == 0


def _next_status(sock: socket.socket, wanted: str, seen: list[str], timeout: float = 10.0) -> str:
    """Read datagrams until a STATUS= line containing ``wanted``; all are kept in ``seen``."""
    deadline = time.monotonic() + timeout
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            message = sock.recv(4096).decode()
        except TimeoutError:
            raise AssertionError(f"no STATUS= with {wanted!r} within {timeout}s: {seen}") from None
        seen.append(message)
        if message.startswith("STATUS=") and wanted in message:
            return message


def test_status_line_carries_each_providers_limit_and_follows_changes(
    rig: Rig, notify_socket: tuple[str, socket.socket]
) -> None:
    path, sock = notify_socket
    sidecar = rig.start(rig.config(STATIC), env=clean_env(NOTIFY_SOCKET=path))
    seen: list[str] = []
    status = _next_status(sock, "p1=20 (discovered)", seen)
    assert status == "STATUS=p1=20 (discovered), static=3 (provider)"
    assert "READY=1" in seen
    rig.capacity.set(models={"workhorse": 12})
    assert _next_status(sock, "p1=12", seen) == "STATUS=p1=12 (discovered), static=3 (provider)"
    # sent when it changes, not at every refresh (0.3 s here)
    time.sleep(1.5)
    sock.settimeout(0.01)
    later = []
    with pytest.raises(TimeoutError):
        while True:
            later.append(sock.recv(4096).decode())
    assert [m for m in later if m.startswith("STATUS=")] == [], later
    assert sidecar.poll() is None


def test_r_g3_await_legacy_pidfile_that_never_appears_is_refused_at_start(
    segment_name: str, write_config: Callable[..., Path], tmp_path: Path
) -> None:
    config = write_config({"providers": [{"id": "p"}]})
    typo = tmp_path / "run" / "legacy-handlr.pid"
    out = run_sidecar(
        config, segment_name, "--await-legacy", str(typo), "--await-legacy-grace", "0.5"
    )
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"--await-legacy {typo}: no such pidfile" in errors[0], out.stderr
    assert "Traceback" not in out.stderr
    assert "has exited" not in out.stderr


def _legacy_writes_its_pid_then_exits(
    rig: Rig, legacy: subprocess.Popen[bytes], pidfile: Path
) -> None:
    """The legacy gateway writes its pidfile: the sidecar drains (limit 0) while it lives
    and publishes the discovered limit once it has exited."""
    pidfile.write_text(f"{legacy.pid}\n")
    p = rig.wait("p1", lambda p: p["source"] == "legacy_drain")
    assert p["effective_limit"] == 0
    legacy.kill()
    legacy.wait()
    rig.wait("p1", discovered(20), what="drain over")


def test_r_g3_await_legacy_pidfile_that_appears_within_the_grace_is_awaited(
    rig: Rig, legacy: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    pidfile = tmp_path / "legacy.pid"
    sidecar = rig.start(rig.config(), "--await-legacy", str(pidfile), "--await-legacy-grace", "20")
    _wait_log(sidecar, "does not exist yet")
    _legacy_writes_its_pid_then_exits(rig, legacy, pidfile)


def test_r_g3_an_empty_pidfile_is_waited_for_until_the_legacy_gateway_writes_its_pid(
    rig: Rig, legacy: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """A pidfile made and not yet written (what ``echo $$ > file`` and most daemons do)
    is waited for within the grace, not read as "does not hold a pid" with an exit 2,
    which its unit never restarts."""
    pidfile = tmp_path / "legacy.pid"
    pidfile.touch(mode=0o644)
    sidecar = rig.start(rig.config(), "--await-legacy", str(pidfile), "--await-legacy-grace", "20")
    _wait_log(sidecar, "is empty")
    time.sleep(0.5)  # several reads of the empty file
    assert sidecar.poll() is None, sidecar.log_text()
    _legacy_writes_its_pid_then_exits(rig, legacy, pidfile)


def test_r_g3_a_pidfile_still_empty_after_the_grace_is_refused_at_start(
    segment_name: str, write_config: Callable[..., Path], tmp_path: Path
) -> None:
    config = write_config({"providers": [{"id": "p"}]})
    pidfile = tmp_path / "legacy.pid"
    pidfile.touch(mode=0o644)
    out = run_sidecar(
        config, segment_name, "--await-legacy", str(pidfile), "--await-legacy-grace", "0.5"
    )
    assert out.returncode == 2, out.stderr
    assert f"--await-legacy {pidfile}: pidfile does not hold a pid" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


NOBODY = 65534


@pytest.mark.linux("mounts a /proc with hidepid in a mount namespace (unshare, setpriv)")
@pytest.mark.parametrize("dropped", ["sys_ptrace,kill", "sys_ptrace"])
def test_r_g3_a_legacy_pid_that_proc_hides_is_awaited_not_taken_for_exited(
    dropped: str, rig: Rig, tmp_path: Path
) -> None:
    """The sidecar in a mount namespace whose /proc is mounted hidepid=invisible (what
    ProtectProc=invisible does), awaiting another user's process it cannot see: the
    drain holds until that process exits.

    The legacy process is nobody's ``sleep``; the sidecar keeps uid 0 (so it runs the
    venv's interpreter and reads the checkout wherever they are, and its segment is
    root's like the test's) but leaves group 0 (the /proc mount's exempt ``gid=``) and
    CAP_SYS_PTRACE, which is what lets a process see through hidepid. Without CAP_KILL,
    ``kill(pid, 0)`` says EPERM (someone else's); with it, it succeeds although /proc
    shows nothing, and the process must still count as alive (R-A5).
    """
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv to mount a hidepid /proc")
    segment_name = rig.segment
    config = rig.config()
    legacy = subprocess.Popen(["sleep", "60"], user=NOBODY, group=NOBODY, extra_groups=[])
    log_path = tmp_path / "sidecar.log"
    drop = ",".join(f"-{cap}" for cap in dropped.split(","))
    script = (
        "mount -t proc -o hidepid=invisible proc /proc && "
        f'exec setpriv --regid={NOBODY} --clear-groups --bounding-set {drop} "$@"'
    )
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
    argv += [EXE, "sidecar", "--config", str(config), "--segment", segment_name]
    argv += ["--refresh", "0.3", "--await-legacy", str(legacy.pid)]
    with open(log_path, "wb") as err:
        sidecar = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=err, env=clean_env())
    try:
        _wait_log_file(sidecar, log_path, "sidecar started")
        p = wait_provider(segment_name, "p1", lambda p: p["discovered"] == 20, timeout=30)
        text = log_path.read_text()
        assert p["source"] == "legacy_drain" and p["effective_limit"] == 0, text
        assert "hidepid=invisible" in text and "does not show it" in text, text
        assert "not running" not in text
        legacy.kill()
        legacy.wait()
        wait_provider(segment_name, "p1", discovered(20), timeout=30, what="drain over")
    finally:
        legacy.kill()
        legacy.wait()
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(10)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            sidecar.wait()


def _wait_log_file(proc: subprocess.Popen[bytes], log_path: Path, text: str) -> None:
    """Until the sidecar logs ``text``; its start-up on a loaded machine is not the test's
    business, but its death is (pytest-timeout bounds a wedge)."""
    while text not in log_path.read_text(errors="replace"):
        assert proc.poll() is None, log_path.read_text(errors="replace")
        time.sleep(0.05)


def test_sighup_while_waiting_for_the_legacy_pidfile_does_not_kill_the_sidecar(
    segment_name: str,
    write_config: Callable[..., Path],
    start_sidecar: StartSidecar,
    tmp_path: Path,
) -> None:
    config = write_config({"providers": [{"id": "p", "maxConcurrent": 3}]})
    pidfile = tmp_path / "legacy.pid"
    sidecar = start_sidecar(
        config, segment_name, "--await-legacy", str(pidfile), "--await-legacy-grace", "20"
    )
    _wait_log(sidecar, "does not exist yet")  # still starting up: no reload handler yet
    sidecar.signal(signal.SIGHUP)
    pidfile.write_text("999999999\n")  # names no process: the upgrade is over
    wait_provider(segment_name, "p", lambda p: p["effective_limit"] == 3)
    assert sidecar.poll() is None, sidecar.log_text()


@pytest.mark.parametrize("grace", ["-1", "26", "nan"])
def test_an_await_legacy_grace_beyond_the_start_timeout_is_refused(
    grace: str, segment_name: str, write_config: Callable[..., Path]
) -> None:
    config = write_config({"providers": [{"id": "p"}]})
    out = run_sidecar(config, segment_name, "--await-legacy-grace", grace)
    assert out.returncode == 2
    assert "--await-legacy-grace must be" in out.stderr and "Traceback" not in out.stderr
