"""A simulated inference worker on loopback, in the shape of a real server.

For the demo and the tests. The default shape is ``llama-server``:
``GET /props`` answers ``{"total_slots": N, ...}`` (``--parallel N`` sets N
on a real one) and ``GET /health`` answers 200 ``{"status": "ok"}`` or, when
unhealthy, 503 as a loading llama-server does. Other shapes (``shape=``,
``router simworker --shape``) answer the endpoints the router reads from
that server, with the field names of its source (docs/router.md):
``llama-server-router`` (``/models`` with per-model ``status``, ``/props``
without ``total_slots`` unless ``?model=``), ``sglang`` (``/server_info``,
or only ``/get_server_info`` with ``old_names``), ``tgi`` (``/info``),
``lmstudio`` (``/api/v1/models``), ``vllm`` (``/health``, ``/metrics``),
``ollama`` (``GET /`` "Ollama is running", ``/api/tags``) and ``llama-swap``
(``/running`` with each model's ``cmd``; ``/upstream/MODEL/props`` only counts
what would have loaded a model). SGLang answers ``/ready`` (``/health`` with
``old_names``). Every shape lists its models on ``/v1/models``
(a ``llama-server`` only when a model name is given). With ``api_key`` every
path except ``/health`` and ``/`` wants ``Authorization: Bearer KEY`` (401
otherwise), as ``llama-server --api-key`` does. ``load_triggers`` counts the
requests that would have loaded a model on the real server.

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
import hmac
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from .kinds import SHAPES
from .pinning import http_url

PropsFault = Literal["garbage", "error", "hang"]
Shape = str
"""One of :data:`SHAPES` (``capacity_router/kinds.py``: the kinds with a simulated shape)."""
ModelState = Literal["unloaded", "loading", "loaded", "sleeping", "failed"]
"""``failed``: router mode's ``unloaded`` with ``failed: true`` (its load failed)."""

# What each real server answers without a key (llama.cpp server-http.cpp public
# endpoints; llama-swap's /health has no apiKeyAuth; Ollama's root).
_PUBLIC = frozenset({"/health", "/v1/health", "/"})
_HEALTH_PATH: dict[str, str] = {"ollama": "/", "lmstudio": "/api/v1/models", "sglang": "/ready"}
Answer = tuple[int | str, Any]


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

    def _send_text(self, status: int, text: str) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _not_found(self) -> None:
        self._send(
            404, b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
        )

    def do_GET(self) -> None:
        sim = self.server.sim
        path, _, query = self.path.partition("?")
        params = dict(urllib.parse.parse_qsl(query))
        if path not in _PUBLIC and not sim._authorized(self.headers.get("Authorization")):
            self._send(
                401,
                b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}',
            )
            return
        shape = sim.shape
        health = _HEALTH_PATH.get(shape, "/health")
        if shape == "sglang" and sim.old_names:
            health = "/health"  # before 0.5.20: no /ready
        if path == health:
            self._health(sim)
            return
        if (sim.openai or shape == "vllm") and (path == "/metrics" or _is_upstream_metrics(path)):
            body = sim._metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        answer = sim._answer(path, params)
        if answer is None:
            self._not_found()
        elif answer[0] == "text":
            self._send_text(200, str(answer[1]))
        elif answer[0] == "props":
            self._props(sim)
        else:
            status, body = answer
            self._send(int(status), json.dumps(body).encode())

    def _health(self, sim: SimWorker) -> None:
        if not sim.healthy:
            self._send(
                503,
                b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}',
            )
        elif sim.shape == "llama-swap":
            self._send_text(200, "OK")
        elif sim.shape == "ollama":
            self._send_text(200, "Ollama is running")
        elif sim.shape == "lmstudio":
            self._send(200, json.dumps(sim._lmstudio_models()).encode())
        else:
            self._send(200, b'{"status":"ok"}')

    def _props(self, sim: SimWorker) -> None:
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
        model: str | None = None,
        *,
        openai: bool = False,
        delay: float = 0.5,
        shape: Shape = "llama-server",
        api_key: str | None = None,
        dp_size: int = 1,
        old_names: bool = False,
        n_ctx: int = 4096,
    ) -> None:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
        if dp_size < 1:
            raise ValueError("dp_size must be at least 1")
        self.host = host
        self.port = port
        self.model = model if model is not None else "sim-model"
        # A llama-server without a named model lists nothing (its /v1/models is
        # then not consulted), so any registered id counts, as before ids were checked.
        self.lists_models = model is not None or openai or shape != "llama-server"
        self.openai = openai
        self.delay = delay
        self.shape: Shape = shape
        self._api_key = api_key
        self.dp_size = dp_size
        self.old_names = old_names  # sglang before /server_info: /get_server_info only
        self.n_ctx = n_ctx  # llama-server: each slot's context, in /props
        self._model_states: dict[str, ModelState] = {self.model: "loaded"}
        self.models_autoload = True  # router mode: False is --no-models-autoload
        self.load_triggers = 0  # requests that would have loaded a model on a real server
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
        return http_url(self.host, self.port)

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

    def set_model_state(self, model: str, state: ModelState | None) -> None:
        """Router-mode / llama-swap model states (None: the model is not offered)."""
        with self._lock:
            if state is None:
                self._model_states.pop(model, None)
            else:
                self._model_states[model] = state

    def model_states(self) -> dict[str, ModelState]:
        with self._lock:
            return dict(self._model_states)

    def set_healthy(self, healthy: bool) -> None:  # noqa: FBT001 (a setter of one flag)
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
            "default_generation_settings": {"n_ctx": self.n_ctx, "params": {}},
            "total_slots": slots,
            "model_path": f"/models/{self.model}.gguf",
            "build_info": "simworker",
        }

    def _authorized(self, header: str | None) -> bool:
        if self._api_key is None:
            return True
        expected = f"Bearer {self._api_key}".encode()
        return header is not None and hmac.compare_digest(header.encode(), expected)

    def _model_list(self) -> dict[str, Any]:
        """``GET /v1/models``: OpenAI's list; llama.cpp adds ``aliases`` and, in
        router mode, ``status`` ``{"value": ...}`` (server-models.cpp get_router_models)."""
        created = int(time.time())
        data: list[dict[str, Any]] = []
        for name, state in self.model_states().items():
            entry: dict[str, Any] = {"id": name, "object": "model", "created": created}
            if self.shape in ("llama-server", "llama-server-router"):
                entry.update(owned_by="llamacpp", aliases=[])
                if self.shape == "llama-server-router":
                    entry["status"] = {"value": state, "args": []}
                    if state == "failed":
                        entry["status"] = {
                            "value": "unloaded",
                            "args": [],
                            "failed": True,
                            "exit_code": 1,
                        }
            else:
                entry["owned_by"] = {"vllm": "vllm", "llama-swap": "llama-swap"}.get(
                    self.shape, "simworker"
                )
            data.append(entry)
        return {"object": "list", "data": data}

    def _lmstudio_models(self) -> dict[str, Any]:
        """LM Studio REST v1 ``GET /api/v1/models`` (fields per its list-models docs)."""
        models = []
        for name, state in self.model_states().items():
            loaded = state == "loaded"
            instances = (
                [{"id": name, "config": {"context_length": 4096, "parallel": self.slots}}]
                if loaded
                else []
            )
            models.append(
                {
                    "type": "llm",
                    "publisher": "simworker",
                    "key": name,
                    "display_name": name,
                    "loaded_instances": instances,
                    "max_context_length": 4096,
                    "format": "gguf",
                }
            )
        return {"models": models}

    def _answer(self, path: str, params: dict[str, str]) -> Answer | None:
        """The body for ``GET path`` in this worker's shape, or None (404)."""
        shape = self.shape
        if path == "/v1/models" and self.lists_models:
            return (200, self._model_list())
        if shape == "llama-server":
            return ("props", None) if path == "/props" else None
        if shape == "llama-server-router":
            return self._router_answer(path, params)
        if shape == "sglang":
            if path == "/get_server_info" or (path == "/server_info" and not self.old_names):
                per_dp = self.slots // self.dp_size
                state = {
                    "last_gen_throughput": 0.0,
                    "effective_max_running_requests_per_dp": per_dp,
                }
                return (
                    200,
                    {
                        "model_path": self.model,
                        "dp_size": self.dp_size,
                        "tp_size": 1,
                        "internal_states": [dict(state) for _ in range(self.dp_size)],
                        "version": "simworker",
                    },
                )
            return None
        if shape == "tgi":
            if path == "/info":
                return (
                    200,
                    {
                        "model_id": self.model,
                        "model_dtype": "torch.float16",
                        "model_device_type": "cpu",
                        "max_concurrent_requests": self.slots,
                        "max_best_of": 2,
                        "max_stop_sequences": 4,
                        "version": "simworker",
                    },
                )
            return None
        if shape == "ollama":
            if path == "/api/tags":
                listed = [
                    {
                        "name": m,
                        "model": m,
                        "details": {"format": "gguf", "family": "llama", "families": ["llama"]},
                        "capabilities": ["completion"],
                    }
                    for m in self.model_states()
                ]
                return (200, {"models": listed})
            return None
        if shape == "llama-swap":
            return self._swap_answer(path)
        return None

    def _router_answer(self, path: str, params: dict[str, str]) -> Answer | None:
        if path == "/models":
            return (200, self._model_list())
        if path != "/props":
            return None
        name = params.get("model", "")
        if not name:  # the router's own props: no total_slots (get_router_props)
            return (
                200,
                {
                    "role": "router",
                    "max_instances": 4,
                    "models_autoload": self.models_autoload,
                    "model_alias": "llama-server",
                    "model_path": "none",
                    "default_generation_settings": {"params": {}, "n_ctx": 0},
                    "build_info": "simworker",
                },
            )
        state = self.model_states().get(name)
        if state is None:
            error = {"code": 400, "message": f"model '{name}' not found"}
            return (400, {"error": {**error, "type": "invalid_request_error"}})
        autoload = params.get("autoload", "true") in ("true", "1")
        if state not in ("loaded", "sleeping", "loading"):
            if autoload:
                with self._lock:
                    self.load_triggers += 1
            error = {"code": 400, "message": "model is not loaded"}
            return (400, {"error": {**error, "type": "invalid_request_error"}})
        return ("props", None)

    def _swap_answer(self, path: str) -> Answer | None:
        states = self.model_states()
        if path == "/running":
            running = [
                {
                    "model": m,
                    "state": "ready",
                    "cmd": f"llama-server --port 5800 -m /models/{m}.gguf --parallel {self.slots}",
                    "proxy": "http://127.0.0.1:5800",
                    "ttl": 0,
                    "name": "",
                    "description": "",
                }
                for m, s in states.items()
                if s == "loaded"
            ]
            return (200, {"running": running})
        parts = path.split("/")  # "", "upstream", model, "props"
        if len(parts) == 4 and parts[1] == "upstream" and parts[3] == "props":
            model = urllib.parse.unquote(parts[2])
            if model not in states:
                return (400, {"error": "model id required in path"})
            if states[model] != "loaded":
                with self._lock:
                    self.load_triggers += 1  # llama-swap would start this model's process
            return ("props", None)
        return None
