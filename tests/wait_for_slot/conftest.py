"""Fixtures for wait-for-slot: a real loopback server speaking vLLM's exposition text.

The server answers a script of :class:`Answer` values, one per request (the
last repeats), and records every request it receives, so a test can assert on
what was sent (method, path, Authorization) as well as on the exit code.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

MODEL = "workhorse"


def vllm_metrics(
    running: Sequence[float] = (0.0,),
    waiting: Sequence[float] = (0.0,),
    *,
    model: str = MODEL,
    omit: Sequence[str] = (),
) -> str:
    """Exposition text shaped like vLLM v1 behind llama-swap: one series per ``engine``.

    ``running[i]``/``waiting[i]`` are engine i's gauges. ``omit`` drops whole
    families by name. Around them: process and GC metrics, ``_total`` counters,
    a histogram, info gauges, and a decoy family whose name extends a gauge's.
    """
    families: list[tuple[str, str]] = []

    def add(name: str, text: str) -> None:
        if name not in omit:
            families.append((name, text))

    add(
        "python_gc",
        "# HELP python_gc_objects_collected_total Objects collected during gc\n"
        "# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 14219.0\n'
        'python_gc_objects_collected_total{generation="1"} 3102.0\n'
        'python_gc_objects_collected_total{generation="2"} 488.0\n',
    )
    add(
        "process",
        "# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
        "# TYPE process_resident_memory_bytes gauge\n"
        "process_resident_memory_bytes 2.318307328e+09\n"
        "# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
        "# TYPE process_start_time_seconds gauge\n"
        "process_start_time_seconds 1.75e+09\n",
    )

    def per_engine(name: str, values: Sequence[float], extra: str = "") -> str:
        return "".join(
            f'{name}{{engine="{i}",{extra}model_name="{model}"}} {float(v)!r}\n'
            for i, v in enumerate(values)
        )

    add(
        "vllm:num_requests_running",
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        + per_engine("vllm:num_requests_running", running),
    )
    add(
        "vllm:num_requests_waiting",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        + per_engine("vllm:num_requests_waiting", waiting),
    )
    add(
        "decoy",
        "# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason (not the gauge).\n"
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        + per_engine(
            "vllm:num_requests_waiting_by_reason", [50.0] * len(waiting), 'reason="capacity",'
        ),
    )
    add(
        "vllm:gpu_cache_usage_perc",
        "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        + per_engine("vllm:gpu_cache_usage_perc", [0.4375] * len(running)),
    )
    add(
        "vllm:prompt_tokens_total",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        + per_engine("vllm:prompt_tokens_total", [918273.0] * len(running)),
    )
    add(
        "vllm:request_success_total",
        "# HELP vllm:request_success_total Count of successfully processed requests.\n"
        "# TYPE vllm:request_success_total counter\n"
        + per_engine(
            "vllm:request_success_total", [412.0] * len(running), 'finished_reason="stop",'
        )
        + per_engine(
            "vllm:request_success_total", [9.0] * len(running), 'finished_reason="length",'
        ),
    )
    buckets = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5",
               "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "+Inf")  # fmt: skip
    histogram = ""
    for i in range(len(running)):
        for n, le in enumerate(buckets):
            count = min(421.0, 3.0 * n * n)
            histogram += (
                f'vllm:time_to_first_token_seconds_bucket{{engine="{i}",le="{le}",'
                f'model_name="{model}"}} {421.0 if le == "+Inf" else count}\n'
            )
        histogram += (
            f'vllm:time_to_first_token_seconds_count{{engine="{i}",model_name="{model}"}} 421.0\n'
            f'vllm:time_to_first_token_seconds_sum{{engine="{i}",model_name="{model}"}} 57.31\n'
        )
    add(
        "vllm:time_to_first_token_seconds",
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n"
        "# TYPE vllm:time_to_first_token_seconds histogram\n" + histogram,
    )
    add(
        "vllm:cache_config_info",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        + "".join(
            f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="{i}",'
            f'gpu_memory_utilization="0.9",num_gpu_blocks="27913",prefix_caching="True"}} 1.0\n'
            for i in range(len(running))
        ),
    )
    add(
        "vllm:lora_requests_info",
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7500001e+09\n',
    )
    return "".join(text for _, text in families)


@dataclass
class Answer:
    """What the server does for one request."""

    status: int = 200
    body: bytes | str = b""
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False  # accept, then never answer
    drip: bool = False  # send headers, then one body byte every 0.1 s, forever
    no_length: bool = False  # no Content-Length: the body ends when the connection closes


def metrics(running: Sequence[float] = (0.0,), waiting: Sequence[float] = (0.0,)) -> Answer:
    return Answer(
        body=vllm_metrics(running, waiting),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


class MetricsServer:
    """A threaded HTTP server on loopback, port 0 (``::1`` when ``ipv6``)."""

    def __init__(self, *, ipv6: bool = False, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[Seen] = []
        self.script: list[Answer] = [metrics()]
        self.require_bearer: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _any(self) -> None:
                with owner._lock:
                    owner.requests.append(
                        Seen(
                            self.command, self.path, {k.lower(): v for k, v in self.headers.items()}
                        )
                    )
                    answer = owner.script[min(len(owner.requests), len(owner.script)) - 1]
                    bearer = owner.require_bearer
                if bearer is not None and self.headers.get("Authorization") != f"Bearer {bearer}":
                    answer = Answer(401, "unauthorized")
                if answer.hang:
                    owner._stop.wait(60)
                    return
                body = answer.body.encode() if isinstance(answer.body, str) else answer.body
                self.send_response(answer.status)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                if answer.drip:
                    self.send_header("Content-Length", "1000000")
                    self.end_headers()
                    while not owner._stop.wait(0.1):
                        try:
                            self.wfile.write(b"#")
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                if not answer.no_length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client stopped reading (the body cap)
                    self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _any

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ipv6 else socket.AF_INET
            daemon_threads = True

        self._server = Server(("::1" if ipv6 else "127.0.0.1", 0), Handler)
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        host = "[::1]" if ipv6 else "127.0.0.1"
        scheme = "https" if tls is not None else "http"
        self.port = self._server.server_address[1]
        self.url = f"{scheme}://{host}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def serve(self, *answers: Answer) -> None:
        with self._lock:
            self.script = list(answers)

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer()
    yield srv
    srv.close()


@pytest.fixture
def make_server() -> Iterator[Callable[..., MetricsServer]]:
    made: list[MetricsServer] = []

    def make(**kwargs: object) -> MetricsServer:
        srv = MetricsServer(**kwargs)  # type: ignore[arg-type]
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()


def _cli_argv() -> list[str]:
    script = Path(sys.executable).parent / "gateway-capacity"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "gateway_capacity"]


CLI = _cli_argv()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CAPACITY_SEGMENT"}
    env.update(extra)
    return env


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    elapsed: float


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Ran:
    """``gateway-capacity wait-for-slot ARGS`` as a real process."""
    started = time.monotonic()
    done = subprocess.run(
        [*CLI, "wait-for-slot", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return Ran(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


@pytest.fixture
def cli_process() -> Callable[..., Ran]:
    """The installed ``gateway-capacity wait-for-slot`` as a real process."""
    return run_cli


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Ran]:
    """The same CLI entry point (``gateway_capacity.cli.main``), run in this process.

    Most tests use this: a process start costs about a second on a loaded
    machine. ``env`` replaces the environment for the call.
    """
    from gateway_capacity.cli import main

    def run(*args: str, env: dict[str, str] | None = None) -> Ran:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env if env is not None else clean_env())
        capsys.readouterr()
        started = time.monotonic()
        try:
            code = main(["wait-for-slot", *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os.environ.clear()
            os.environ.update(saved)
        elapsed = time.monotonic() - started
        out, err = capsys.readouterr()
        return Ran(code, out, err, elapsed)

    return run


@pytest.fixture
def cli_argv() -> list[str]:
    """argv of the real ``gateway-capacity wait-for-slot``, for tests that spawn it themselves."""
    return [*CLI, "wait-for-slot"]


@pytest.fixture
def cli_env() -> Callable[..., dict[str, str]]:
    return clean_env


@pytest.fixture
def gauges() -> Callable[..., Answer]:
    """``gauges(running, waiting)``: a 200 answer with vLLM text, one series per engine."""
    return metrics


@pytest.fixture
def vllm_text() -> Callable[..., str]:
    return vllm_metrics


@pytest.fixture
def key_file(tmp_path: Path) -> Callable[[bytes], Path]:
    """Write a key file with mode 600 and return its path."""

    def write(content: bytes, name: str = "upstream.key") -> Path:
        path = tmp_path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        return path

    return write


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def answer() -> type[Answer]:
    """The :class:`Answer` type, for scripting the server."""
    return Answer
