"""Helpers for the capacity router tests (imported by conftest and the tests)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import httpx
from gwtest import wait_for

from capacity_router import RouterServer, SimWorker

KEY = "router-test-key-5f2c9a"


def write_registry(path: Path, workers: list[dict[str, Any]]) -> None:
    """Replace the registry atomically (what a careful operator's editor does)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"workers": workers}))
    os.replace(tmp, path)


def worker(
    worker_id: str, urls: list[str], models: list[str], slots: Any = None, **extra: Any
) -> dict[str, Any]:
    return {
        "id": worker_id,
        "urls": urls,
        "models": models,
        "slots": slots if slots is not None else {"source": "props"},
        **extra,
    }


def serve_args(registry: Path, key_file: Path, listen: str = "127.0.0.1:0") -> list[str]:
    """``router serve``'s arguments for a registry and key file, listening on ``listen``."""
    return ["serve", "--workers", str(registry), "--key-file", str(key_file), "--listen", listen]


def get_capacity(router: RouterServer, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(f"{router.url}/v1/capacity", headers=headers, trust_env=False)


def rows(snapshot: Any) -> dict[str, int]:
    return {m.id: m.max_concurrent_requests for m in snapshot.models}


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that writes no access log to stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LoopbackHTTP:
    """An http.server for ``handler`` on 127.0.0.1, port 0, served from a daemon thread."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ScriptedServer(LoopbackHTTP):
    """Answers each path with a scripted (status, headers, body); 404 otherwise."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.requested: list[str] = []  # every path asked, in order
        self.hangs: set[str] = set()  # paths that never answer (until stop)
        self._stopping = threading.Event()
        outer = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                outer.requested.append(self.path)
                if self.path in outer.hangs:
                    outer._stopping.wait(60)
                    return
                status, headers, body = outer.routes.get(self.path, (404, {}, b"not found"))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(Handler)

    def route(self, path: str, status: int, body: bytes | str = b"", **headers: str) -> None:
        self.routes[path] = (status, headers, body.encode() if isinstance(body, str) else body)

    def stop(self) -> None:
        self._stopping.set()
        super().stop()


class _PeerTransport(asyncio.Transport):
    """The server side of a connection from ``peer``: a non-loopback client cannot
    connect in a test (loopback only), so the router's own connection object is given
    the address a tailnet peer would have, and its answer is read from here."""

    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer = peer
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return (self.peer, 50000) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def status_from_peer(router: RouterServer, peer: str, request: str) -> int:
    """The status ``router`` answers ``request`` (raw HTTP/1.1) from ``peer``'s address."""
    transport = _PeerTransport(peer)

    async def send() -> None:
        connections = router._connections
        assert connections is not None
        conn = connections.factory()
        conn.connection_made(transport)
        conn.data_received(request.encode())

    assert router._server is not None
    router._server.call(send()).result(timeout=5)
    wait_for(lambda: b"\r\n\r\n" in transport.written, what="the answer")
    return int(transport.written.split(b" ", 2)[1])


# The fixtures' types (tests/router/conftest.py), one home for every test module.
Router = Callable[..., RouterServer]
Sim = Callable[..., SimWorker]
