"""Helpers of the LiteLLM tests: a fake OpenAI upstream on loopback that holds its answers,
configs, and real uvicorn servers (LiteLLM's proxy, the example gateway)."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import served
from gwtest import ROOT, availability, wait_until
from served import Served, serve_app, uvicorn_argv

PROVIDER = "local-inference"
ALIAS = "local-workhorse"  # LiteLLM's model_name = the gateway alias
UPSTREAM_MODEL = "workhorse"


class HoldingUpstream(ThreadingHTTPServer):
    """``POST /v1/chat/completions`` (and ``/v1/completions``): a streamed answer sends its
    first chunk at once, then every answer waits until ``release`` is set (or ``hold``
    seconds have passed). Counts what it saw, and the most it held at once (``peak``)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)
        self.release = threading.Event()
        self.hold = 60.0
        self.lock = threading.Lock()
        self.seen = 0
        self.models: list[str] = []
        self.inflight = 0
        self.peak = 0

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = self.inflight

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _UpstreamHandler(BaseHTTPRequestHandler):
    server: HoldingUpstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        with self.server.lock:
            self.server.seen += 1
            self.server.models.append(body.get("model"))
            self.server.inflight += 1
            self.server.peak = max(self.server.peak, self.server.inflight)
        try:
            self._answer(body)
        finally:
            with self.server.lock:
                self.server.inflight -= 1

    def _answer(self, body: dict[str, Any]) -> None:
        model = body.get("model", "?")
        hold = self.server.hold
        try:
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(2):
                    chunk = {
                        "id": "c",
                        "object": "chat.completion.chunk",
                        "created": 1,
                        "model": model,
                        "choices": [
                            {"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}
                        ],
                    }
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    self.server.release.wait(hold)
                self.wfile.write(b"data: [DONE]\n\n")
                return
            self.server.release.wait(hold)
            if not self.path.endswith("/chat/completions"):  # a text completion
                choice = {"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}
                text = {"id": "t", "object": "text_completion", "created": 1, "model": model}
                self._send({**text, "choices": [choice]})
                return
            self._send(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 1,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ok"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )
        except OSError:
            pass  # the caller went away

    def _send(self, doc: dict[str, Any]) -> None:
        answer = json.dumps(doc).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except OSError:
            pass  # the caller went away


def skip_without_litellm() -> None:
    """Skip the calling module where the litellm extra is not installed."""
    missing = [m for m in ("litellm", "fastapi", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"not installed: {', '.join(missing)} (make test installs the litellm extra: "
            "pip install -e '.[litellm]')",
            allow_module_level=True,
        )


@pytest.fixture
def upstream() -> Iterator[HoldingUpstream]:
    server = HoldingUpstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def gateway_config(tmp_path: Path, upstream: HoldingUpstream, key_file: Path) -> Path:
    """One provider, limit 2, naming LiteLLM's model_name as its alias."""
    path = tmp_path / "gateway.json"
    path.write_text(
        json.dumps(
            {
                "providers": [
                    {
                        "id": PROVIDER,
                        "baseUrl": upstream.base,
                        "credentialFile": str(key_file),
                        "maxConcurrent": 2,
                        "models": {ALIAS: UPSTREAM_MODEL},
                    }
                ]
            }
        )
    )
    return path


@pytest.fixture
def master_key() -> str:
    return "sk-" + secrets.token_hex(24)


def litellm_yaml(directory: Path, upstream: HoldingUpstream, callback: bool) -> Path:
    lines = [
        "model_list:",
        f"  - model_name: {ALIAS}",
        "    litellm_params:",
        f"      model: openai/{UPSTREAM_MODEL}",
        f"      api_base: {upstream.base}",
        "      api_key: sk-upstream",
        "      num_retries: 0",
    ]
    if callback:
        lines += ["litellm_settings:", "  callbacks: litellm_admission.proxy_handler_instance"]
    path = directory / "litellm.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


StartServed = Callable[..., Served]


@pytest.fixture
def serve(tmp_path: Path, segment_name: str, gateway_config: Path) -> Iterator[StartServed]:
    """Start ``uvicorn APP`` on a socket bound here; wait until ``/health/liveliness`` or
    ``/healthz`` answers."""
    started: list[Served] = []

    def start(
        app: str, app_dir: Path, *, workers: int = 1, env: dict[str, str] | None = None
    ) -> Served:
        full_env = {
            **os.environ,
            "GATEWAY_CONFIG": str(gateway_config),
            "GATEWAY_CAPACITY_SEGMENT": segment_name,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch from the internet at import
            "LITELLM_TELEMETRY": "False",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        options = ("--workers", str(workers), "--no-access-log")
        server = serve_app(
            lambda sock: uvicorn_argv(app, app_dir, sock, *options),
            tmp_path / f"serve-{len(started)}.log",
            full_env,
            cwd=tmp_path,
            new_session=True,
            backlog=256,
        )
        started.append(server)
        server.wait_healthy(("/health/liveliness", "/healthz"), timeout=90, every=0.25)
        # One worker answering is not all of them: a worker still importing LiteLLM
        # accepts nothing, and every request lands on the first (seen on a loaded CI run).
        ready = "Application startup complete."
        every_worker = wait_until(lambda: server.output().count(ready) >= workers, timeout=90)
        assert every_worker, server.output()[-3000:]
        return server

    yield start
    for server in started:
        server.stop(timeout=30)


def counts(segment: str) -> tuple[int, int]:
    p = next(p for p in availability(segment)["providers"] if p["id"] == PROVIDER)
    return int(p["running"]), int(p["waiting"])


def wait_counts(segment: str, expect: tuple[int, int], timeout: float = 30) -> None:
    served.wait_counts(lambda: counts(segment), expect, timeout, every=0.2)
