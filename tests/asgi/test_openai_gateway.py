"""examples/openai_gateway.py under real uvicorn, in front of a real loopback upstream."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_support import EXAMPLES, example_gateway
from gwtest import run_cli
from served import Served, gunicorn_argv, serve_app


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True
    seen: list[dict[str, Any]]


class _Handler(BaseHTTPRequestHandler):
    server: _Upstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(
            {
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": body,
            }
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i in range(3):
            self.wfile.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[_Upstream]:
    """A loopback upstream answering with ``handler``, on a thread, until the block ends."""
    server = _Upstream(("127.0.0.1", 0), handler)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def upstream() -> Iterator[_Upstream]:
    with _serving(_Handler) as server:
        yield server


def _provider(upstream: _Upstream, key_file: Path) -> dict[str, Any]:
    """The gateway config's one provider, at ``upstream``."""
    return {
        "id": "local-inference",
        "baseUrl": f"http://127.0.0.1:{upstream.server_address[1]}/v1",
        "credentialFile": str(key_file),
        "maxConcurrent": 2,
        "models": {"local-workhorse": "workhorse"},
    }


@pytest.fixture
def gateway(
    tmp_path: Path, upstream: _Upstream, key_file: Path, segment_name: str
) -> Iterator[Served]:
    env = {"GATEWAY_GENERATION": "example-1"}
    provider = _provider(upstream, key_file)
    with example_gateway(tmp_path, segment_name, provider, env=env) as served:
        yield served


def _counters(segment: str) -> dict[str, int]:
    doc = json.loads(run_cli("inspect", "--segment", segment, "--json").stdout)
    provider = next(p for p in doc["providers"] if p["id"] == "local-inference")
    return {**provider["counters"], "running": provider["running"]}


def test_example_gateway_streams_with_the_providers_key_and_the_upstream_model_id(
    gateway: Served, upstream: _Upstream, key: str, segment_name: str
) -> None:
    base = gateway.base
    body = {"model": "local-workhorse", "stream": True, "messages": [{"role": "user"}]}
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json=body,
        headers={"x-request-id": "r-1"},
        timeout=30,
    ) as answer:
        data = answer.read()
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == 4
    [seen] = upstream.seen
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["authorization"] == f"Bearer {key}"  # the provider's credential
    assert seen["headers"]["x-request-id"] == "r-1"
    assert seen["body"]["model"] == "workhorse"  # alias mapped to the upstream id (R-C2)
    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["local-workhorse"]
    counters = _counters(segment_name)
    assert counters["admitted_total"] == 1 and counters["running"] == 0  # /v1/models: no slot
    assert key not in gateway.output()  # R-P7


def test_example_gateway_refuses_unknown_models_and_reports_an_unreachable_provider(
    gateway: Served, upstream: _Upstream, key: str, segment_name: str
) -> None:
    base = gateway.base
    body = {"model": "gpt-nonexistent", "messages": []}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found"
    assert upstream.seen == []
    upstream.shutdown()
    upstream.server_close()  # nothing listens there now
    body["model"] = "local-workhorse"
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "upstream_unreachable"
    counters = _counters(segment_name)
    assert counters["running"] == 0 and counters["admitted_total"] == 2  # slots released
    assert key not in gateway.output()


# gunicorn's default keep-alive: the shortest idle timeout of the servers inference sits
# behind (uvicorn's, vLLM's, SGLang's and llama.cpp's are 5 s)
IDLE_CLOSE_S = 2.0


class _KeptAlive(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive; a connection idle ``IDLE_CLOSE_S`` is closed when the next
    request comes on it, unanswered: what a server's idle close looks like to a client that
    sent on the connection as the server closed it (the race, made certain)."""

    protocol_version = "HTTP/1.1"
    server: _Upstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        idle_since = getattr(self, "idle_since", None)
        if idle_since is not None and time.monotonic() - idle_since >= IDLE_CLOSE_S:
            self.server.seen.append({"closed idle": True})
            self.close_connection = True
            return
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append({"answered": True})
        body = b"data: {}\n\ndata: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.idle_since = time.monotonic()


def test_example_gateway_never_sends_on_a_connection_the_upstream_closes_as_idle(
    tmp_path: Path, key_file: Path, segment_name: str
) -> None:
    """A completion admitted is relayed, not answered 502 because the pooled connection
    it was sent on had been idle as long as the upstream keeps one (R-A1's slot is spent,
    the upstream never saw the request): the gateway's pool lets a connection go before
    the shortest idle timeout of the servers in front of inference."""
    body = {"model": "local-workhorse", "stream": True, "messages": [{"role": "user"}]}
    with _serving(_KeptAlive) as server:
        provider = _provider(server, key_file)
        with example_gateway(tmp_path, segment_name, provider) as gateway:
            url = f"{gateway.base}/v1/chat/completions"
            first = httpx.post(url, json=body, timeout=30)
            time.sleep(IDLE_CLOSE_S + 0.3)
            second = httpx.post(url, json=body, timeout=30)
    assert (first.status_code, second.status_code) == (200, 200), (second.text, server.seen)
    assert server.seen == [{"answered": True}, {"answered": True}]


@pytest.mark.parametrize("config", ["unset", "missing"])
def test_example_gateway_without_a_usable_config_halts_gunicorn_with_boot_error_3(
    tmp_path: Path, config: str
) -> None:
    """GATEWAY_CONFIG is required (no silent examples/gateway.json),
    and a worker that cannot start exits 3, gunicorn's worker boot error: the master stops
    with the reason instead of restarting the worker forever."""
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CONFIG"}
    if config == "missing":
        env["GATEWAY_CONFIG"] = str(tmp_path / "no-such.json")
    # One worker: with two that both fail at once, gunicorn 23 itself may exit 1, the
    # second worker's exit raising its HaltServer again inside the first one's halt (seen
    # in a fresh-clone run); what the example controls is its worker's exit code.
    gunicorn = serve_app(
        lambda sock: gunicorn_argv("openai_gateway:app", EXAMPLES, sock, workers=1),
        tmp_path / "gunicorn.log",
        env,
        cwd=tmp_path,
    )
    try:
        code = gunicorn.proc.wait(timeout=60)
    finally:
        if gunicorn.proc.poll() is None:
            gunicorn.proc.kill()
            gunicorn.proc.wait()
    text = gunicorn.output()
    assert code == 3, text
    reason = "GATEWAY_CONFIG is not set" if config == "unset" else "no-such.json"
    assert any(reason in line and "openai_gateway:" in line for line in text.splitlines()), text
    assert text.count("Booting worker") == 1, text  # halted, never restarted
