"""What the sidecar takes from files and addresses another user controls.

The attacker really runs as ``nobody`` (``tests/as_nobody.py``); the sidecar is the
operator's process, started as the unit starts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from sidecar_e2e import EXE, Rig, clean_env, run_sidecar

from sidecar.daemon import metrics_exposure
from sidecar.legacy import parse_legacy
from sidecar.startup import StartupError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from as_nobody import NOBODY, as_nobody, public_dir

__all__ = ["public_dir"]  # a fixture


Refused = Callable[..., list[str]]


@pytest.fixture
def refused(segment_name: str, write_config: Callable[..., Path]) -> Refused:
    """``refused(*options)``: a sidecar started with ``options`` on a config of one static
    provider must refuse to start (exit 2, no traceback); its ERROR lines."""
    config = write_config({"providers": [{"id": "p"}]})

    def start(*extra: str) -> list[str]:
        out = run_sidecar(config, segment_name, *extra)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr
        return [line for line in out.stderr.splitlines() if " ERROR " in line]

    return start


def test_r_g6_a_pidfile_others_can_rewrite_is_refused_before_anything_drains(
    public_dir: Path, legacy: subprocess.Popen[bytes], refused: Refused
) -> None:
    """nobody rewrites a pidfile in a directory everyone may write to `1`: the start
    fails, rather than hold every opted-in provider at 0 for as long as pid 1 lives."""
    run_dir = public_dir / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    pidfile = run_dir / "legacy.pid"
    pidfile.write_text(f"{legacy.pid}\n")

    def rewrite() -> None:
        os.rename(pidfile, str(pidfile) + ".x")
        with open(pidfile, "w") as f:
            f.write("1\n")

    as_nobody(rewrite)
    (error,) = refused("--await-legacy", str(pidfile))
    assert f"--await-legacy {pidfile}: pidfile not trusted: directory {run_dir} is writable" in (
        error
    )


def test_r_g6_a_pidfile_owned_by_another_user_is_refused_naming_its_owner(
    public_dir: Path, legacy: subprocess.Popen[bytes], refused: Refused
) -> None:
    sticky = public_dir / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    pidfile = sticky / "legacy.pid"
    _write_pidfile_as_nobody(pidfile, legacy.pid)
    assert pidfile.stat().st_uid == NOBODY
    (error,) = refused("--await-legacy", str(pidfile))
    assert "is owned by uid 65534 (nobody), not root or this user" in error


def test_r_g6_a_group_writable_pidfile_is_refused(tmp_path: Path, refused: Refused) -> None:
    pidfile = tmp_path / "legacy.pid"
    pidfile.write_text(f"{os.getpid()}\n")
    pidfile.chmod(0o664)
    (error,) = refused("--await-legacy", str(pidfile))
    assert "writable by group or others (mode 0664)" in error


@pytest.mark.parametrize("how", ["pid", "pidfile"])
def test_r_g3_await_legacy_may_not_name_pid_1(how: str, tmp_path: Path, refused: Refused) -> None:
    target = "1"
    if how == "pidfile":
        (tmp_path / "init.pid").write_text("1\n")
        target = str(tmp_path / "init.pid")
    (error,) = refused("--await-legacy", target)
    assert "pid 1, init (pid 1): a drain that only its exit could end (refused)" in error


def test_r_g3_await_legacy_may_not_name_the_parent_pid(
    legacy: subprocess.Popen[bytes], refused: Refused
) -> None:
    """Under --parent-pid the sidecar exits with that process: awaiting it would drain
    for as long as the sidecar runs."""
    pid = str(legacy.pid)
    (error,) = refused("--parent-pid", pid, "--await-legacy", pid)
    assert f"names pid {pid}, the --parent-pid process" in error


def test_r_g3_await_legacy_may_not_name_the_sidecar_itself() -> None:
    with pytest.raises(StartupError, match="the sidecar itself"):
        parse_legacy([str(os.getpid())])


def test_r_g3_a_drain_longer_than_await_legacy_max_warns_once_and_fails_the_check(
    rig: Rig, legacy: subprocess.Popen[bytes]
) -> None:
    sidecar = rig.start(rig.config(), "--await-legacy", str(legacy.pid), "--await-legacy-max", "1")
    rig.wait("p1", lambda p: p["source"] == "legacy_drain")
    argv = [EXE, "availability", "--segment", rig.segment, "--check"]

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=clean_env())

    out = check()
    while "legacy drain has lasted" not in out.stdout:  # pytest-timeout bounds the wait
        assert out.returncode == 0, out.stdout
        out = check()
    assert out.returncode == 1
    (line,) = [x for x in out.stdout.splitlines() if "legacy drain" in x]
    assert "over --await-legacy-max" in line and f"pid {legacy.pid} still runs" in line
    warnings = [x for x in sidecar.log_lines() if "over --await-legacy-max" in x]
    assert len(warnings) == 1 and " WARNING " in warnings[0], sidecar.log_text()
    legacy.kill()
    legacy.wait()
    rig.wait("p1", lambda p: p["source"] == "discovered")
    assert "legacy drain" not in check().stdout


@pytest.mark.parametrize(
    ("bound", "exposed"),
    [
        ("127.0.0.1", None),
        ("::1", None),
        ("127.0.0.2", None),
        ("0.0.0.0", "every network this host is on"),
        ("::", "every network this host is on"),
        ("192.0.2.7", "the network of 192.0.2.7"),
    ],
)
def test_metrics_listen_beyond_loopback_is_a_warning_that_says_what_is_exposed(
    bound: str, exposed: str | None
) -> None:
    warning = metrics_exposure(f"{bound}:9464", bound)
    if exposed is None:
        assert warning is None
    else:
        assert warning is not None
        assert f"served without authentication to {exposed}" in warning
        assert "provider ids, limits" in warning


def _write_pidfile_as_nobody(pidfile: Path, pid: int) -> None:
    """``pidfile`` made by nobody (mode 0644, so nobody owns it), holding ``pid``."""

    def write() -> None:
        fd = os.open(pidfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, f"{pid}\n".encode())
        os.close(fd)

    as_nobody(write)


def _runtime_directory_pidfile(public_dir: Path, pid: int) -> tuple[Path, Path]:
    """What a legacy gateway running as nobody leaves: its ``RuntimeDirectory=`` (0755,
    its own) and in it the pidfile it wrote as itself (0644)."""
    run_dir = public_dir / "gateway"
    run_dir.mkdir(mode=0o755)
    os.chown(run_dir, NOBODY, NOBODY)
    pidfile = run_dir / "legacy.pid"
    _write_pidfile_as_nobody(pidfile, pid)
    assert (run_dir.stat().st_uid, pidfile.stat().st_uid) == (NOBODY, NOBODY)
    return run_dir, pidfile


def test_r_g6_a_pidfile_in_the_owner_users_runtime_directory_is_trusted_with_owner(
    public_dir: Path, legacy: subprocess.Popen[bytes], rig: Rig
) -> None:
    """docs/systemd.md's first --await-legacy example, as printed: the legacy gateway's
    user (here nobody) is the one the operator names with --owner, so its pidfile and
    the directory it is in are trusted as the segment is, and the drain runs."""
    _, pidfile = _runtime_directory_pidfile(public_dir, legacy.pid)
    rig.start(rig.config(), "--owner", "nobody", "--await-legacy", str(pidfile))
    rig.wait("p1", lambda p: p["source"] == "legacy_drain" and p["effective_limit"] == 0)
    legacy.kill()
    legacy.wait()
    rig.wait("p1", lambda p: p["source"] == "discovered")


def test_r_g6_the_owner_users_pidfile_without_owner_is_refused_saying_to_name_it(
    public_dir: Path, legacy: subprocess.Popen[bytes], refused: Refused
) -> None:
    run_dir, pidfile = _runtime_directory_pidfile(public_dir, legacy.pid)
    (error,) = refused("--await-legacy", str(pidfile))
    assert (
        f"pidfile not trusted: directory {run_dir} is owned by uid 65534 (nobody), not root "
        "or this user; if that is the legacy gateway's user, name it with --owner USER"
    ) in error


def test_r_g6_a_pidfile_of_a_user_nobody_named_stays_refused_under_owner(
    public_dir: Path, legacy: subprocess.Popen[bytes], refused: Refused
) -> None:
    """--owner trusts the user it names, never another: nobody's pidfile under
    --owner daemon is refused, naming both."""
    run_dir, pidfile = _runtime_directory_pidfile(public_dir, legacy.pid)
    (error,) = refused("--owner", "daemon", "--await-legacy", str(pidfile))
    assert (
        f"directory {run_dir} is owned by uid 65534 (nobody), not root, this user or "
        "uid 1 (daemon) (--owner)"
    ) in error
    run_dir.chmod(0o755)
    os.chown(run_dir, 0, 0)  # the directory now root's: the file itself is still nobody's
    (error,) = refused("--owner", "daemon", "--await-legacy", str(pidfile))
    assert f"{pidfile}: pidfile not trusted: it is owned by uid 65534 (nobody), not" in error
