"""A private ``redis-server`` on 127.0.0.1 for the share-mode tests: no persistence, its
own directory, stopped (or frozen, or restarted empty) by the test."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    def __init__(self, workdir: Path, *extra: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server not installed (scripts/ensure-tools installs it)")
        try:
            import redis  # noqa: F401
        except ImportError:
            pytest.skip("python package 'redis' missing (the test extra)")
        self.exe = exe
        self.extra = list(extra)
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> Any:
        import redis

        password = None
        if "--requirepass" in self.extra:
            password = self.extra[self.extra.index("--requirepass") + 1]
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, password=password)

    def start(self) -> None:
        """Start (again, on the same port, empty: nothing is saved)."""
        for _attempt in range(5):
            self.proc = subprocess.Popen(
                [
                    self.exe,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                    "--daemonize",
                    "no",
                    "--loglevel",
                    "warning",
                    "--logfile",
                    str(self.workdir / "redis.log"),
                    *self.extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            client = self.client()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                with contextlib.suppress(Exception):
                    if client.ping():
                        return
                time.sleep(0.02)
            self.stop()
            self.port = _free_port()  # taken meanwhile: another one
        raise RuntimeError("redis-server did not start")

    def fresh(self) -> None:
        """Running (started again if a test stopped it) and empty."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.client().flushall()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
