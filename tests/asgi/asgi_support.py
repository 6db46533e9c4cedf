"""Helpers of the ASGI middleware tests: a served app, the example gateway, raw HTTP
requests, segment members."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gwtest import ROOT, availability
from served import Served, serve_app, uvicorn_argv

APP_DIR = ROOT / "tests" / "asgi"
EXAMPLES = ROOT / "examples"


@dataclass
class Server:
    """tests/asgi/asgi_app.py served: ``/v1/hold?name=N`` is admitted, says ``admitted``
    and holds its slot until the test releases N; ``/health`` is not admitted."""

    proc: subprocess.Popen[bytes]
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

    def admitted_holds(self, prefix: str, count: int) -> list[RawRequest]:
        """``count`` requests to ``/v1/hold`` (named prefix0, prefix1, ...), each admitted."""
        held = [RawRequest(self.port, f"/v1/hold?name={prefix}{i}") for i in range(count)]
        for r in held:
            r.read_until(b"admitted")
        return held

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def provider(self, provider_id: str = "p1") -> dict[str, object]:
        for p in availability(self.segment)["providers"]:
            if p["id"] == provider_id:
                return dict(p)
        raise AssertionError(f"no provider {provider_id}")

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


@contextmanager
def example_gateway(
    tmp_path: Path,
    segment: str,
    provider: dict[str, Any],
    *options: str,
    env: dict[str, str] | None = None,
) -> Iterator[Served]:
    """examples/openai_gateway.py under uvicorn (``options``: uvicorn's), on a gateway
    config of the one ``provider``; answering ``/healthz`` when it is handed over."""
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"providers": [provider]}))
    env = {
        **os.environ,
        "GATEWAY_CONFIG": str(config),
        "GATEWAY_CAPACITY_SEGMENT": segment,
        **(env or {}),
    }
    gateway = serve_app(
        lambda sock: uvicorn_argv("openai_gateway:app", EXAMPLES, sock, *options),
        tmp_path / "gateway.log",
        env,
    )
    try:
        gateway.wait_healthy()
        yield gateway
    finally:
        gateway.stop()


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

    def __init__(
        self,
        port: int,
        path: str,
        *,
        method: str = "GET",
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        send_body: bool = True,
    ) -> None:
        """``body`` goes with its ``Content-Length`` unless ``headers`` say otherwise;
        ``send_body=False`` sends the head alone (a client still to send its body)."""
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        head = {"Host": "127.0.0.1", "Connection": "close"}
        if body is not None:
            head["Content-Length"] = str(len(body))
        head.update(headers or {})
        lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
        self.sock.sendall(f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode())
        if body is not None and send_body:
            self.sock.sendall(body)
        self.data = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

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

    def read_match(self, pattern: bytes, what: str, timeout: float = 30) -> re.Match[bytes]:
        """Read until ``pattern`` matches what came; fail naming ``what`` on a close."""
        self.sock.settimeout(timeout)
        while (match := re.search(pattern, self.data)) is None:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before {what}: {self.data!r}")
            self.data += chunk
        return match

    def admitted_pid(self, timeout: float = 30) -> int:
        """Wait for the app's first line and return the pid of the worker serving us."""
        return int(self.read_match(rb"admitted (\d+)\n", "admission", timeout).group(1))

    def body_line(self, timeout: float = 30) -> tuple[str, int]:
        """The app's ``body <sha256> <length>`` line: what the app read of the body."""
        self.read_until(b"\n", timeout)
        match = self.read_match(rb"body ([0-9a-f]{64}) (\d+)\n", "the body line", timeout)
        return match.group(1).decode(), int(match.group(2))

    def status(self) -> int:
        self.read_until(b"\r\n")
        return int(self.data.split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()
