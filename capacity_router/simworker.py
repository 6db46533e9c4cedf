"""A simulated llama.cpp-style worker: ``/props`` and ``/health`` on loopback.

For the demo and the tests. ``GET /props`` answers like ``llama-server``
(``{"total_slots": N, ...}``; ``--parallel N`` sets N on a real one) and
``GET /health`` answers 200 ``{"status": "ok"}`` or, when unhealthy, 503 as
a loading llama-server does. Nothing else is simulated: no inference.

The standard library is enough here (a few requests a second, no keep-alive:
each answer closes its connection, so a stopped worker is really gone).
Faults for tests, via :meth:`SimWorker.set_props_fault`: ``"garbage"``
(200 with a body that is not JSON), ``"error"`` (500), ``"hang"`` (no answer
until the fault is cleared or the worker stops).
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

PropsFault = Literal["garbage", "error", "hang"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, sim: SimWorker) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sim = sim
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "simworker"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the demo has its own display

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        sim = self.server.sim
        path = self.path.split("?", 1)[0]
        if path == "/health":
            if sim.healthy:
                self._send(200, b'{"status":"ok"}')
            else:
                self._send(
                    503,
                    b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}',
                )
        elif path == "/props":
            sim._count_props()
            fault = sim.props_fault
            if fault == "hang":
                sim._wait_hang()
                self.close_connection = True
            elif fault == "garbage":
                self._send(200, b"<html>not json</html>")
            elif fault == "error":
                self._send(500, b'{"error":{"code":500,"message":"internal error"}}')
            else:
                self._send(200, json.dumps(sim._props()).encode())
        else:
            self._send(
                404, b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
            )


class SimWorker:
    """One simulated worker. ``start()`` returns the bound port; ``url`` is its base URL."""

    def __init__(
        self, slots: int = 10, host: str = "127.0.0.1", port: int = 0, model: str = "sim-model"
    ) -> None:
        self.host = host
        self.port = port
        self.model = model
        self._lock = threading.Lock()
        self._slots = slots
        self._healthy = True
        self._props_fault: PropsFault | None = None
        self._props_requests = 0
        self._release_hang = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"SimWorker(url={self.url!r}, slots={self.slots})"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def slots(self) -> int:
        with self._lock:
            return self._slots

    @property
    def healthy(self) -> bool:
        with self._lock:
            return self._healthy

    @property
    def props_fault(self) -> PropsFault | None:
        with self._lock:
            return self._props_fault

    @property
    def props_requests(self) -> int:
        """How many ``GET /props`` this worker has answered (or hung on)."""
        with self._lock:
            return self._props_requests

    def set_slots(self, n: int) -> None:
        """Like restarting llama-server with ``--parallel n``."""
        with self._lock:
            self._slots = n

    def set_healthy(self, healthy: bool) -> None:
        with self._lock:
            self._healthy = healthy

    def set_props_fault(self, fault: PropsFault | None) -> None:
        with self._lock:
            self._props_fault = fault
            if fault == "hang":
                self._release_hang.clear()
            else:
                self._release_hang.set()

    def start(self) -> int:
        if self._server is not None:
            raise RuntimeError("SimWorker already started")
        self._server = _Server(self.host, self.port, self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"simworker-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self._release_hang.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> SimWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- used by the handler ------------------------------------------------

    def _count_props(self) -> None:
        with self._lock:
            self._props_requests += 1

    def _wait_hang(self) -> None:
        self._release_hang.wait(timeout=60)

    def _props(self) -> dict[str, object]:
        with self._lock:
            slots = self._slots
        return {
            "default_generation_settings": {"n_ctx": 4096, "params": {}},
            "total_slots": slots,
            "model_path": f"/models/{self.model}.gguf",
            "build_info": "simworker",
        }
