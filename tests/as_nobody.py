"""Run a few steps as another local user, for real: docs/SECURITY.md's "another local user".

The tests run as root; ``as_nobody(fn)`` forks, drops to uid/gid 65534 in the
child (``setgroups([])``, ``setgid``, ``setuid``: no capability is left) and
runs ``fn`` there. Fork rather than exec: the interpreter lives under /root,
which nobody cannot open. ``fn`` must only use what is already imported.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

NOBODY = 65534


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user (nobody)")


def as_nobody(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child as nobody; fail the test if it raised."""
    need_root()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-2000:])
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        error = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"as nobody: {error}"


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A root-owned 0755 directory under /tmp that nobody can reach (pytest's tmp_path
    is under a 0700 directory)."""
    directory = Path(tempfile.mkdtemp(prefix="gwcap-attack-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class NobodyListener:
    """A TCP listener owned by nobody on a loopback port: what a local user can do while
    the router is down. ``received`` holds what connections sent, once it is stopped."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """``port``: a port another process just left (a worker down), else any free one."""
        import socket

        need_root()
        self.host = host
        self.received = b""
        control_r, self._control_w = os.pipe()
        self._data_r, data_w = os.pipe()
        ready_r, ready_w = os.pipe()
        self._pid = os.fork()
        if self._pid == 0:
            code = 0
            try:
                os.close(self._control_w)
                os.close(self._data_r)
                os.close(ready_r)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(8)
                os.write(ready_w, str(sock.getsockname()[1]).encode())
                os.close(ready_w)
                self._serve(sock, control_r, data_w)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(control_r)
        os.close(data_w)
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as f:
            self.port = int(f.read() or b"0")
        assert self.port, "nobody's listener did not start"

    @staticmethod
    def _serve(sock: object, control: int, out: int) -> None:
        import select
        import socket

        assert isinstance(sock, socket.socket)
        while True:
            ready, _, _ = select.select([sock, control], [], [])
            if control in ready:
                return
            conn, _ = sock.accept()
            conn.settimeout(2.0)
            with contextlib.suppress(OSError):
                os.write(out, conn.recv(65536))
            conn.close()

    def stop(self) -> bytes:
        if self._pid:
            os.close(self._control_w)
            with os.fdopen(self._data_r, "rb") as f:
                self.received = f.read()
            os.waitpid(self._pid, 0)
            self._pid = 0
        return self.received

    def __enter__(self) -> NobodyListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
