"""Helpers of the ASGI middleware tests: a served app, raw HTTP requests, segment members."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gwtest import ROOT, availability

APP_DIR = ROOT / "tests" / "asgi"


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    segment: str
    release_dir: Path
    log: Path
    pidfile: Path | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def release(self, name: str = "all") -> None:
        (self.release_dir / name).touch()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def provider(self) -> dict[str, object]:
        for p in availability(self.segment)["providers"]:
            if p["id"] == "p1":
                return dict(p)
        raise AssertionError("no provider p1")

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


StartServer = Callable[..., "Server"]


def gunicorn_no_control_socket() -> list[str]:
    """``--no-control-socket`` where this gunicorn has one (newer gunicorns open
    ``~/.gunicorn/gunicorn.ctl``, one path for every gunicorn of the user); the 23.x that
    ``litellm[proxy]`` pins has neither the socket nor the option."""
    from gunicorn.config import KNOWN_SETTINGS

    flag = "--no-control-socket"
    return [flag] if any(flag in (s.cli or ()) for s in KNOWN_SETTINGS) else []


def listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def attached_members(segment: str, generation: str) -> int:
    from shm_layout.segment import SegmentError
    from shm_layout.view import read_view

    try:
        view = read_view(segment)
    except SegmentError:
        return 0
    return sum(1 for m in view.members if m.alive and m.generation == generation)


def members(segment: str) -> list[tuple[int, str]]:
    from shm_layout.view import read_view

    return sorted((m.pid, m.generation) for m in read_view(segment).members if m.alive)


class RawRequest:
    """One HTTP/1.1 request on its own connection, read by hand (the tests need the
    connection itself: to hold it open while waiting, or to close it early)."""

    def __init__(self, port: int, path: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
        )
        self.data = b""

    def read_until(self, marker: bytes, timeout: float = 30) -> bytes:
        self.sock.settimeout(timeout)
        while marker not in self.data:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before {marker!r}: {self.data!r}")
            self.data += chunk
        return self.data

    def read_all(self, timeout: float = 30) -> bytes:
        self.sock.settimeout(timeout)
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.data += chunk
        self.sock.close()
        return self.data

    def admitted_pid(self, timeout: float = 30) -> int:
        """Wait for the app's first line and return the pid of the worker serving us."""
        self.sock.settimeout(timeout)
        while (match := re.search(rb"admitted (\d+)\n", self.data)) is None:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before admission: {self.data!r}")
            self.data += chunk
        return int(match.group(1))

    def status(self) -> int:
        self.read_until(b"\r\n")
        return int(self.data.split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()
