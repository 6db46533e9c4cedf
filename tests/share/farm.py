"""A fake farm on 127.0.0.1: the capacity contract for the sidecars, and ``GET /work?ms=N``
for the handlers, counting concurrent requests as the upstream sees them."""

from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

MODEL = "workhorse"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a worker killed mid-request leaves a broken pipe: expected


class Farm:
    """``capacity`` is what ``/v1/capacity`` announces. The capacity *in force* at an
    arrival is the highest one announced within ``grace`` seconds before it (the
    gateways learn of a drop at their next probe); an arrival that finds more requests
    running than that is a violation."""

    def __init__(self, key: str, capacity: int, grace: float) -> None:
        self.key = key
        self.grace = grace
        self._lock = threading.Lock()
        self._announced: list[tuple[float, int]] = [(0.0, capacity)]
        # (max_request_tokens, max_running_tokens) the rows state (R-K7); None: none
        self.tokens: tuple[int, int] | None = None
        self.running = 0
        self.peak = 0
        self.served = 0
        self.arrivals: list[float] = []  # monotonic, one per request the farm ran
        self.violations: list[tuple[float, int, int]] = []  # (time, running, in force)
        farm = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path == "/v1/capacity":
                    if self.headers.get("Authorization") != f"Bearer {farm.key}":
                        return self._send(401, b"")
                    body = {
                        "object": "inference_capacity",
                        "version": 1,
                        "complete": True,
                        "observed_at": time.time(),
                        "models": [{"id": MODEL, "max_concurrent_requests": farm.capacity}],
                    }
                    if farm.tokens is not None:
                        row: dict[str, Any] = body["models"][0]  # type: ignore[index]
                        row["max_request_tokens"], row["max_running_tokens"] = farm.tokens
                    return self._send(200, json.dumps(body).encode())
                if url.path == "/work":
                    ms = float(parse_qs(url.query).get("ms", ["20"])[0])
                    farm._arrive()
                    try:
                        time.sleep(ms / 1000)
                    finally:
                        farm._leave()
                    return self._send(200, b"{}")
                self._send(404, b"")

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    @property
    def capacity(self) -> int:
        return self._announced[-1][1]

    def set_capacity(self, capacity: int) -> None:
        with self._lock:
            self._announced.append((time.monotonic(), capacity))

    def in_force(self, now: float) -> int:
        recent = [c for t, c in self._announced if t >= now - self.grace]
        before = [c for t, c in self._announced if t < now - self.grace]
        return max(recent + before[-1:])

    def _arrive(self) -> None:
        with self._lock:
            self.running += 1
            self.served += 1
            self.peak = max(self.peak, self.running)
            now = time.monotonic()
            self.arrivals.append(now)
            limit = self.in_force(now)
            if self.running > limit:
                self.violations.append((now, self.running, limit))

    def _leave(self) -> None:
        with self._lock:
            self.running -= 1

    def longest_gap(self, since: float) -> float:
        """The longest time after ``since`` (monotonic) in which the farm started
        nothing, up to now."""
        with self._lock:
            times = [since, *(t for t in self.arrivals if t > since), time.monotonic()]
        return max(b - a for a, b in itertools.pairwise(times))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
