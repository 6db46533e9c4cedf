"""A simulated llama.cpp-style worker: ``/props`` and ``/health`` on loopback.

For the demo and the tests. ``GET /props`` answers like ``llama-server``
(``{"total_slots": N, ...}``; ``--parallel N`` sets N on a real one) and
``GET /health`` answers 200 ``{"status": "ok"}`` or, when unhealthy, 503 as
a loading llama-server does.

With ``openai=True`` (``gateway-capacity router simworker --openai``) it is
also a fake OpenAI-compatible upstream, something to point
``examples/openai_gateway.py`` or LiteLLM at:

- ``POST /v1/chat/completions``, streaming (SSE, ``stream: true``) or not:
  canned text, ``max_tokens`` chunks (5 by default, at most 64), the whole
  answer taking ``delay`` seconds. At most ``slots`` completions run at once;
  the others wait for a slot, as on a real server. Any model name and any
  bearer are accepted.
- ``GET /v1/models``: its one model.
- ``GET /metrics`` and ``GET /upstream/{model}/metrics``: what llama-swap
  passes through from vLLM, the gauges ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting`` of those completions, for trying
  ``gateway-capacity wait-for-slot`` (metrics mode).

The standard library is enough here (a few requests a second, no keep-alive:
each answer closes its connection, so a stopped worker is really gone).
Faults for tests, via :meth:`SimWorker.set_props_fault`: ``"garbage"``
(200 with a body that is not JSON), ``"error"`` (500), ``"hang"`` (no answer
until the fault is cleared or the worker stops).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
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
        if sim.openai and (path == "/metrics" or _is_upstream_metrics(path)):
            body = sim._metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if sim.openai and path == "/v1/models":
            model = {"id": sim.model, "object": "model", "owned_by": "simworker"}
            self._send(200, json.dumps({"object": "list", "data": [model]}).encode())
            return
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

    def do_POST(self) -> None:
        sim = self.server.sim
        if not sim.openai or self.path.split("?", 1)[0] != "/v1/chat/completions":
            self._send(404, b'{"error":{"code":404,"message":"File Not Found"}}')
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            request = json.loads(self.rfile.read(length)) if 0 < length <= 1 << 20 else None
        except ValueError:
            request = None
        if not isinstance(request, dict):
            self._send(400, b'{"error":{"message":"the body must be a JSON object"}}')
            return
        max_tokens = request.get("max_tokens")
        chunks = max_tokens if isinstance(max_tokens, int) and 0 < max_tokens <= 64 else 5
        named = request.get("model")
        model = named if isinstance(named, str) else sim.model
        with sim._completion():
            if request.get("stream") is True:
                self._stream(model, chunks, sim.delay)
            else:
                time.sleep(sim.delay)
                self._send(200, json.dumps(_completion(model, chunks)).encode())

    def _stream(self, model: str, chunks: int, delay: float) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        try:
            for i in range(chunks):
                time.sleep(delay / chunks)
                last = i == chunks - 1
                chunk = {
                    "id": "chatcmpl-sim",
                    "object": "chat.completion.chunk",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": f"t{i} "},
                            "finish_reason": "stop" if last else None,
                        }
                    ],
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            pass  # the client went away: its slot is freed all the same


def _is_upstream_metrics(path: str) -> bool:
    parts = path.split("/")  # "", "upstream", model, "metrics"
    return len(parts) == 4 and parts[1] == "upstream" and parts[3] == "metrics" and bool(parts[2])


def _completion(model: str, chunks: int) -> dict[str, Any]:
    text = " ".join(f"t{i}" for i in range(chunks))
    return {
        "id": "chatcmpl-sim",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": chunks, "total_tokens": chunks + 1},
    }


class SimWorker:
    """One simulated worker. ``start()`` returns the bound port; ``url`` is its base URL."""

    def __init__(
        self,
        slots: int = 10,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "sim-model",
        *,
        openai: bool = False,
        delay: float = 0.5,
    ) -> None:
        self.host = host
        self.port = port
        self.model = model
        self.openai = openai
        self.delay = delay
        self._room = threading.Condition()
        self._running = 0
        self._waiting = 0
        self.completions = 0  # completions answered (openai mode)
        self.peak_running = 0
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
        """Like restarting llama-server with ``--parallel n`` (0 holds every completion)."""
        with self._lock:
            self._slots = n
        with self._room:  # completions waiting for a slot look again
            self._room.notify_all()

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

    @property
    def in_flight(self) -> tuple[int, int]:
        """Completions (running, waiting for a slot) now, in openai mode."""
        with self._room:
            return self._running, self._waiting

    # -- used by the handler ------------------------------------------------

    @contextlib.contextmanager
    def _completion(self) -> Iterator[None]:
        """One of ``slots`` running completions; the others wait, as on a real server."""
        with self._room:
            self._waiting += 1
            try:
                while self._running >= self.slots:
                    self._room.wait()
            finally:
                self._waiting -= 1
            self._running += 1
            self.peak_running = max(self.peak_running, self._running)
        try:
            yield
        finally:
            with self._room:
                self._running -= 1
                self.completions += 1
                self._room.notify()

    def _metrics(self) -> str:
        running, waiting = self.in_flight
        label = f'{{model_name="{self.model}"}}'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {running}.0\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} {waiting}.0\n"
        )

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
