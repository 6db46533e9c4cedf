"""A Debian 12 container with systemd as PID 1, for tests/systemd/test_nspawn.py.

Booted with ``systemd-nspawn`` on a root that ``scripts/nspawn-root`` builds
with mmdebstrap once and caches under /var/cache/gateway-capacity. The root is
booted with ``--volatile=overlay``: every write goes to a tmpfs on top, so the
cache stays as built and nothing of a run survives it. The container shares the
host's network namespace (no ``--private-network``), so its 127.0.0.1 is the
host's: the capacity router the test runs on the host is the sidecar's
provider. Commands run inside with ``nsenter -t <PID 1> -a``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import signal
import subprocess
import time
from pathlib import Path

from gwtest import wait_for

REPO = Path(__file__).resolve().parents[2]
INSIDE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NSPAWN_DIR = Path("/run/systemd/nspawn")


class BoxError(Exception):
    """The container could not be set up: the reason to skip with."""


def build_root() -> Path:
    """The cached root, built when missing (mmdebstrap from Debian's mirror)."""
    done = subprocess.run(
        [str(REPO / "scripts" / "nspawn-root")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BoxError(f"cannot build the container root with mmdebstrap: {last}")
    return Path(done.stdout.strip())


class Box:
    """One booted container. :meth:`close` always tears it down."""

    def __init__(self, root: Path, log_path: Path) -> None:
        self.root = root
        self.log_path = log_path
        self.name = "gwcap-" + secrets.token_hex(4)
        self._mounted_nspawn_dir = False
        self._made_nspawn_dir = False
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid1 = 0

    # --- life cycle ---------------------------------------------------------------------
    def boot(self, timeout: float = 120.0) -> None:
        if not NSPAWN_DIR.exists():
            # nspawn keeps its mount propagation directories here; on a host that was
            # not booted by systemd it is missing. Both are undone by close().
            NSPAWN_DIR.mkdir(parents=True)
            self._made_nspawn_dir = True
            mount = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(NSPAWN_DIR)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if mount.returncode != 0:
                raise BoxError(f"cannot mount a tmpfs on {NSPAWN_DIR}: {mount.stderr.strip()}")
            self._mounted_nspawn_dir = True
        env = dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="0")  # cgroup v1 host
        argv = [
            "systemd-nspawn",
            "--keep-unit",
            "--register=no",
            "--quiet",
            "--volatile=overlay",
            "--console=read-only",
            f"--machine={self.name}",
            "-D",
            str(self.root),
            "-b",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self.pid1:
            if self.proc.poll() is not None:
                raise BoxError(f"systemd-nspawn exited {self.proc.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise BoxError(f"the container did not start within {timeout:g}s")
            self.pid1 = self._find_pid1()
            time.sleep(0.1)
        state = ""
        while state not in ("running", "degraded"):
            if time.monotonic() > deadline:
                raise BoxError(f"systemd inside did not finish booting: {state!r}")
            time.sleep(0.3)
            state = self.run("systemctl is-system-running", check=False).stdout.strip()

    def _find_pid1(self) -> int:
        assert self.proc is not None
        for child in _children(self.proc.pid):
            try:
                if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                    return child
            except OSError:
                continue
        return 0

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Power the container off (SIGTERM to nspawn asks PID 1 for a clean
        shutdown); SIGKILL the whole process group if that takes too long."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        if self._mounted_nspawn_dir:
            subprocess.run(["umount", str(NSPAWN_DIR)], capture_output=True, timeout=30)
            self._mounted_nspawn_dir = False
        if self._made_nspawn_dir:
            with contextlib.suppress(OSError):
                NSPAWN_DIR.rmdir()
            self._made_nspawn_dir = False

    # --- inside -------------------------------------------------------------------------
    def run(
        self,
        script: str,
        *,
        check: bool = True,
        timeout: float = 60.0,
        stdin: bytes | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``sh -c script`` as root inside, with a clean environment."""
        clean = {"PATH": INSIDE_PATH, "LANG": "C.UTF-8", "HOME": "/root", **(env or {})}
        argv = ["nsenter", "-t", str(self.pid1), "-a", "env", "-i"]
        argv += [f"{k}={v}" for k, v in clean.items()]
        argv += ["sh", "-c", script]
        done = subprocess.run(
            argv,
            input=stdin.decode("latin-1") if stdin is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            encoding="latin-1",
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"inside: {script!r} exited {done.returncode}\n"
                f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
            )
        return done

    def put(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file inside (through the container, so the cached root stays clean)."""
        raw = data.encode() if isinstance(data, str) else data
        quoted = shlex.quote(path)
        self.run(
            f"mkdir -p $(dirname {quoted}) && cat > {quoted} && chmod {mode:o} {quoted}", stdin=raw
        )

    def copy_tree(self, files: list[str], source: Path, target: str) -> None:
        """Copy ``files`` (relative to ``source``) to ``target`` inside, with tar."""
        tar = subprocess.run(
            ["tar", "-C", str(source), "--null", "-T", "-", "-c"],
            input=b"\0".join(f.encode() for f in files) + b"\0",
            capture_output=True,
            timeout=120,
            check=True,
        )
        argv = [
            "nsenter",
            "-t",
            str(self.pid1),
            "-a",
            "sh",
            "-c",
            f"mkdir -p {shlex.quote(target)} && tar -x -C {shlex.quote(target)}",
        ]
        subprocess.run(argv, input=tar.stdout, capture_output=True, timeout=120, check=True)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run(f"systemctl show {shlex.quote(unit)} -p {','.join(props)}").stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait(self, what: str, predicate: object, timeout: float) -> object:
        """Poll ``predicate()`` (a callable) until truthy; fail naming ``what``."""
        assert callable(predicate)
        return wait_for(predicate, timeout, every=0.3, what=what)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        out += [int(c) for c in text.split()]
    return out


def repo_files() -> list[str]:
    """The checkout's files as a clone would have them (tracked and new, not ignored)."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        timeout=60,
        check=True,
    )
    names = [n.decode() for n in done.stdout.split(b"\0") if n]
    return [n for n in names if (REPO / n).is_file()]
