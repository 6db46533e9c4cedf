"""A loopback HTTP server speaking the capacity contract, steerable from the test."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a sidecar killed mid-request leaves a broken pipe: expected, not news


class CapacityServer:
    """Serves ``GET /v1/capacity``; ``set(...)`` changes the next answer.

    ``status`` other than 200 answers that status with an empty body. The
    bearer is checked when ``key`` is given (401 otherwise). For the failure
    cases: ``body`` (bytes) replaces the snapshot as the 200 body, ``headers``
    are added to every answer (e.g. ``Location`` for a redirect), and
    ``delay`` seconds pass before anything is sent (a hanging router; ``stop``
    releases it).
    """

    def __init__(self, key: str, host: str = "127.0.0.1") -> None:
        self.key = key
        self.models: dict[str, int] = {"workhorse": 20}
        # model -> (max_request_tokens, max_running_tokens), None: the field left out
        self.tokens: dict[str, tuple[int | None, int | None]] = {}
        self.complete = True
        self.status = 200
        self.observed_offset = 0.0
        self.body: bytes | None = None
        self.headers: dict[str, str] = {}
        self.delay = 0.0
        self.requests = 0
        self.auth_headers: list[str] = []
        self._stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests += 1
                server.auth_headers.append(self.headers.get("Authorization", ""))
                if server.delay and server._stopping.wait(server.delay):
                    return
                if self.path != "/v1/capacity":
                    self._send(404, b"")
                elif self.headers.get("Authorization") != f"Bearer {server.key}":
                    self._send(401, b"")
                elif server.status != 200:
                    self._send(server.status, b"")
                elif server.body is not None:
                    self._send(200, server.body)
                else:
                    body: dict[str, Any] = {
                        "object": "inference_capacity",
                        "version": 1,
                        "complete": server.complete,
                        "observed_at": time.time() + server.observed_offset,
                        "models": [server.row(m, n) for m, n in server.models.items()],
                    }
                    self._send(200, json.dumps(body).encode())

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for name, value in server.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = _Server((host, 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> CapacityServer:
        self.thread.start()
        return self

    def row(self, model: str, slots: int) -> dict[str, Any]:
        row: dict[str, Any] = {"id": model, "max_concurrent_requests": slots}
        request, running = self.tokens.get(model, (None, None))
        if request is not None:
            row["max_request_tokens"] = request
        if running is not None:
            row["max_running_tokens"] = running
        return row

    def stop(self) -> None:
        self._stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def set(self, **fields: Any) -> None:
        for k, v in fields.items():
            if not hasattr(self, k):
                raise AttributeError(f"CapacityServer has no setting {k!r}")
            setattr(self, k, v)
