"""Real vLLM, mlx_lm and ``transformers serve`` processes, and the real router in front.

Each server runs from its own venv, installed once into a cache by
scripts/install-real-server (``make real-workers`` sets ``GWCAP_VLLM_PYTHON``,
``GWCAP_MLX_LM_PYTHON`` and ``GWCAP_TRANSFORMERS_PYTHON`` to the venvs' pythons); without
one, its tests skip and say so. Models are the tiny random-weight Llama of tiny_hf.py,
written by the server's own python; ``HF_HUB_OFFLINE=1`` keeps every hub away. The router
is ``gateway-capacity router serve``, a real process, as an operator starts it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from gwtest import free_port, wait_until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ROUTER_KEY = "real-router-key-0123456789"

PYTHON_ENV = {
    "vllm": "GWCAP_VLLM_PYTHON",
    "mlx-lm": "GWCAP_MLX_LM_PYTHON",
    "transformers": "GWCAP_TRANSFORMERS_PYTHON",
}

# Start-up deadlines: honest ones on a shared 2-core machine (vLLM compiles its model).
STARTUP_S = {"vllm": 900.0, "mlx-lm": 300.0, "transformers": 400.0}


def python(kind: str) -> Path | None:
    """The python of ``kind``'s venv, or None (its tests skip)."""
    path = os.environ.get(PYTHON_ENV[kind])
    return Path(path) if path and Path(path).is_file() else None


def skip_reason(kind: str) -> str:
    return (
        f"no {kind} venv: `make real-workers` installs it once (scripts/install-real-server "
        f"{kind}) and sets {PYTHON_ENV[kind]}; an install that cannot happen here says why "
        "in its log under the cache"
    )


def real_marks(kind: str) -> list[pytest.MarkDecorator]:
    """A module's marks: a timeout past ``kind``'s start-up, and a skip without its venv."""
    return [
        pytest.mark.timeout(STARTUP_S[kind] + 600),
        pytest.mark.skipif(python(kind) is None, reason=skip_reason(kind)),
    ]


def loopback(port: int) -> list[str]:
    """The flags every one of these servers takes to listen on 127.0.0.1:``port``."""
    return ["--host", "127.0.0.1", "--port", str(port)]


def offline_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HTTP_PROXY", "HTTPS_PROXY"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_PROXY="*", **extra)
    return env


def tiny_model(kind: str, directory: Path, layers: int = 2) -> Path:
    """The tiny Llama, written by ``kind``'s own python into directory (once).

    More layers make each token slower to compute than to send, so that a client can
    tell streams decoded together from streams decoded one after another."""
    py = python(kind)
    assert py is not None
    out = directory / f"tiny-{kind}-{layers}"
    if not (out / "config.json").exists():
        subprocess.run(
            [str(py), str(HERE / "tiny_hf.py"), str(out), "--layers", str(layers)],
            check=True,
            env=offline_env(),
            capture_output=True,
        )
    return out.resolve()


class RealServer:
    """One server process (its own process group) on 127.0.0.1:``port``."""

    def __init__(
        self, kind: str, argv: list[str], log: Path, port: int, env: dict[str, str] | None = None
    ) -> None:
        self.kind = kind
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._log = log.open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env or offline_env(),
        )

    def wait_healthy(self, timeout: float, every: float = 0.25) -> float:
        """Wait for ``GET /health`` 200; return the seconds since the start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.kind} exited {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(every)
        raise TimeoutError(f"{self.kind} on {self.url} not healthy within {timeout} s; {self.log}")

    def kill(self) -> None:
        """SIGKILL to the whole group (a vLLM engine core is a child process)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with suppress(ProcessLookupError):  # children left behind by a parent gone first
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def start_vllm(
    model: Path,
    port: int,
    log: Path,
    *,
    max_num_seqs: int = 3,
    api_key: str | None = None,
    max_model_len: int = 2048,
    extra: tuple[str, ...] = (),
) -> RealServer:
    """vLLM's OpenAI server; ``extra``: more of its flags (``--num-gpu-blocks-override``)."""
    py = python("vllm")
    assert py is not None
    key = {"VLLM_API_KEY": api_key} if api_key else {}
    return RealServer(
        "vllm",
        [
            str(py),
            "-m",
            "vllm.entrypoints.openai.api_server",
            *loopback(port),
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-model-len",
            str(max_model_len),
            # on the CPU backend the memory fraction is of the whole machine; a fixed
            # KV cache skips that check (the tiny model needs a few MB)
            "--kv-cache-memory-bytes",
            str(256 << 20),
            *extra,
        ],
        log,
        port,
        offline_env(VLLM_CPU_OMP_THREADS_BIND="nobind", **key),
    )


def start_mlx(
    model: Path,
    port: int,
    log: Path,
    *,
    decode_concurrency: int = 32,
    prompt_concurrency: int = 8,
    hub_cache: bool = True,
) -> RealServer:
    """mlx_lm.server; ``hub_cache=False``: no Hugging Face hub cache directory, as on a
    fresh machine (its ``/v1/models`` then answers 200 with an empty body)."""
    py = python("mlx-lm")
    assert py is not None
    home = log.parent / f"hf-home-{port}"
    if hub_cache:
        (home / "hub").mkdir(parents=True, exist_ok=True)
    return RealServer(
        "mlx-lm",
        [
            str(py),
            "-m",
            "mlx_lm",
            "server",
            *loopback(port),
            "--model",
            str(model),
            "--decode-concurrency",
            str(decode_concurrency),
            "--prompt-concurrency",
            str(prompt_concurrency),
        ],
        log,
        port,
        offline_env(HF_HOME=str(home)),
    )


def start_transformers(
    model: Path, port: int, log: Path, *, continuous_batching: bool = False
) -> RealServer:
    py = python("transformers")
    assert py is not None
    cli = py.parent / "transformers"
    return RealServer(
        "transformers",
        [
            str(cli),
            "serve",
            str(model),
            *loopback(port),
            "--device",
            "cpu",
            "--continuous-batching" if continuous_batching else "--no-continuous-batching",
        ],
        log,
        port,
        offline_env(HF_HOME=str(log.parent / "hf-home")),
    )


# -- the router ---------------------------------------------------------------


def write_registry(path: Path, workers: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"workers": workers}))
    os.replace(tmp, path)


class Router:
    """``gateway-capacity router serve`` on 127.0.0.1, port 0, polling every 0.5 s."""

    def __init__(self, work: Path, workers: list[dict[str, Any]]) -> None:
        self.key_file = work / "router.key"
        self.key_file.write_text(ROUTER_KEY + "\n")
        self.key_file.chmod(0o600)
        self.registry = work / "workers.json"
        write_registry(self.registry, workers)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway_capacity",
                "router",
                "serve",
                "--workers",
                str(self.registry),
                "--key-file",
                str(self.key_file),
                "--listen",
                "127.0.0.1:0",
                "--poll",
                "0.5",
            ],
            stdout=subprocess.PIPE,
            stderr=(work / "router.log").open("wb"),
            text=True,
        )
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(60):
                raise AssertionError("the router printed nothing in 60 s")
        line = self.proc.stdout.readline().strip()
        assert line.startswith("serving http://127.0.0.1:"), line
        self.url = line.removeprefix("serving ").removesuffix("/v1/capacity")
        self.headers = {"Authorization": f"Bearer {ROUTER_KEY}"}

    def capacity(self) -> dict[str, Any]:
        answer = httpx.get(f"{self.url}/v1/capacity", headers=self.headers, trust_env=False)
        assert answer.status_code == 200, answer.text
        doc: dict[str, Any] = answer.json()
        return doc

    def rows(self) -> dict[str, int]:
        return {m["id"]: m["max_concurrent_requests"] for m in self.capacity()["models"]}

    def worker(self, worker_id: str = "w") -> dict[str, Any]:
        answer = httpx.get(f"{self.url}/admin/workers", headers=self.headers, trust_env=False)
        assert answer.status_code == 200, answer.text
        for entry in answer.json()["workers"]:
            if entry["id"] == worker_id:
                found: dict[str, Any] = entry
                return found
        raise AssertionError(f"no worker {worker_id} in {answer.text}")

    def wait(self, check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        if not wait_until(check, timeout, every=0.2):
            raise AssertionError(
                f"never {what} within {timeout} s: {self.capacity()} {self.worker()}"
            )

    def show(self, *extra: str) -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway_capacity",
                "router",
                "show",
                "--url",
                self.url,
                "--key-file",
                str(self.key_file),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


@dataclass
class StateLog:
    """Every change of one worker's state as the router reports it, from a thread."""

    router: Router
    worker_id: str = "w"
    seen: list[tuple[float, str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StateLog:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(0.1):
            try:
                entry = self.router.worker(self.worker_id)
            except Exception as exc:  # kept for the report; the watch goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            state = str(entry.get("state", "?"))
            reason = str(entry.get("reason", ""))
            if not self.seen or self.seen[-1][1:] != (state, reason):
                self.seen.append((round(time.monotonic() - t0, 1), state, reason))

    def states(self) -> list[str]:
        out: list[str] = []
        for _, state, _ in self.seen:
            if not out or out[-1] != state:
                out.append(state)
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


# -- one server behind one router, for a test module ---------------------------


def worker_entry(
    port: int, models: list[str], slots: dict[str, Any], **extra: str
) -> dict[str, Any]:
    """The registry's one worker ``w``, at 127.0.0.1:``port``."""
    return {
        "id": "w",
        "urls": [f"http://127.0.0.1:{port}"],
        "models": models,
        "slots": slots,
        **extra,
    }


@dataclass
class Chain:
    """A real server behind a real router, with the worker's states logged from the start."""

    work: Path
    router: Router
    server: RealServer
    log: StateLog
    worker: dict[str, Any]
    model: str
    startup_s: float

    def streams(self, n: int, max_tokens: int, seed: int | None = None) -> Streams:
        """``n`` streams at once through the router, none of which may fail."""
        out = drive_streams(
            f"{self.router.url}/v1", ROUTER_KEY, self.model, n, max_tokens=max_tokens, seed=seed
        )
        assert not out.errors, out.errors
        return out


@contextmanager
def serve_chain(
    work: Path,
    kind: str,
    slots: dict[str, Any],
    start: Callable[[Path, int, Path], RealServer],
    *,
    served: str | None = None,
    also: tuple[str, ...] = (),
    layers: int = 2,
    **extra: str,
) -> Iterator[Chain]:
    """The tiny model served by ``start(model, port, log)`` as ``served`` (its path where
    None), behind a router whose worker ``w`` lists it and ``also``. The router starts
    first, so that its log sees the server start."""
    model = tiny_model(kind, work, layers=layers)
    port = free_port()
    name = served or str(model)
    worker = worker_entry(port, [name, *also], slots, **extra)
    router = Router(work, [worker])
    log = StateLog(router).start()
    server = start(model, port, work / f"{kind}.log")
    try:
        startup = server.wait_healthy(STARTUP_S[kind])
        yield Chain(work, router, server, log, worker, name, startup)
    finally:
        log.stop()
        router.stop()
        server.stop()


def version_of(kind: str, distribution: str) -> str:
    """The installed version of ``distribution``, asked of ``kind``'s own venv."""
    py = python(kind)
    assert py is not None
    return subprocess.run(
        [str(py), "-c", f"import importlib.metadata as m; print(m.version({distribution!r}))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def chat_through(router: Router, model: str, max_tokens: int) -> Any:
    """A streamed chat through the router with the openai SDK, which must end at its length;
    returns the client for more."""
    import openai

    client = openai.OpenAI(
        base_url=f"{router.url}/v1", api_key=ROUTER_KEY, max_retries=0, timeout=120
    )
    chat = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=max_tokens,
            stream=True,
        )
    )
    assert any(c.choices and c.choices[0].delta.content for c in chat)
    assert [c.choices[0].finish_reason for c in chat if c.choices][-1] == "length"
    return client


def kill_until_unreachable(
    router: Router, kill: Callable[[], None], timeout: float = 60.0
) -> tuple[StateLog, float]:
    """Kill, and wait for the router to read the worker unreachable: the states it passed
    through, and the seconds that took."""
    log = StateLog(router).start()
    killed = time.monotonic()
    kill()
    try:
        router.wait(lambda: router.worker()["state"] == "unreachable", "unreachable", timeout)
    finally:
        log.stop()
    return log, time.monotonic() - killed


# -- what a server really runs at once ---------------------------------------


@dataclass
class Streams:
    """Per stream: the times its content chunks arrived, and whether it ended cleanly."""

    times: list[list[float]]
    finish: list[str | None]
    errors: list[str]

    def most_at_once(self, margin: float = 0.5) -> int:
        """The most streams producing at once: overlaps of their [first, last] chunk
        times by more than ``margin`` seconds (a stream queued behind another starts
        the moment that one ends)."""
        spans = sorted((t[0], t[-1]) for t in self.times if t)
        best = 0
        for start, _ in spans:
            best = max(best, sum(1 for s, e in spans if s <= start < e - margin))
        return best


def drive_streams(
    base_url: str,
    api_key: str,
    model: str,
    n: int,
    max_tokens: int,
    timeout: float = 600.0,
    seed: int | None = None,
) -> Streams:
    """``n`` streamed chat completions at once through the official openai SDK."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    times: list[list[float]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    errors: list[str] = []
    go = threading.Barrier(n)

    def one(i: int) -> None:
        try:
            go.wait()
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"stream {i}"}],
                max_tokens=max_tokens,
                stream=True,
                seed=seed,
            )
            for chunk in stream:
                if not chunk.choices:
                    continue
                if chunk.choices[0].delta.content:
                    times[i].append(time.monotonic())
                if chunk.choices[0].finish_reason:
                    finish[i] = chunk.choices[0].finish_reason
        except Exception as exc:  # reported, not raised: the caller asserts on them
            errors.append(f"stream {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return Streams(times, finish, errors)


def streams_alone(server: RealServer, model: Path, n: int, max_tokens: int) -> Streams:
    """``n`` streams at once straight to ``server`` (no router), none of which may fail;
    the server is stopped after."""
    try:
        server.wait_healthy(STARTUP_S[server.kind])
        streams = drive_streams(f"{server.url}/v1", "none", str(model), n, max_tokens=max_tokens)
    finally:
        server.stop()
    assert not streams.errors, streams.errors
    return streams


@contextmanager
def gauge_watch(
    url: str, names: tuple[str, ...], headers: dict[str, str]
) -> Iterator[dict[str, float]]:
    """The highest value of each Prometheus gauge seen at ``url`` while the block runs."""
    from capacity_router.sources import gauge_sum

    top: dict[str, float] = {name: 0.0 for name in names}
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            try:
                body = httpx.get(url, headers=headers, timeout=5).content
            except httpx.HTTPError:
                continue
            for name in names:
                value = gauge_sum(body, name)
                if value is not None:
                    top[name] = max(top[name], value)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield top
    finally:
        stop.set()
        thread.join(5)
