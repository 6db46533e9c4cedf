"""The ASGI middleware's cost per request, and what its Retry-After does for SDK retries.

``run_asgi_cost``: the same trivial app under uvicorn, without and with
``AdmissionMiddleware``, driven by a bounded loopback load generator (``CONCURRENCY``
keep-alive connections, raw HTTP/1.1, in this process); the server's CPU per request is
read from ``/proc/<pid>/task/*/schedstat`` (nanoseconds, every thread: the admission
threads count too). Rounds alternate between the two servers.

``run_sdk_retry``: the example gateway (``examples/openai_gateway.py``, limit 4) in front
of a slow fake OpenAI upstream, 80 concurrent requests from the official ``openai`` SDK
(default retries, which honour ``Retry-After``), once with ``Retry-After: 1`` fixed and
once with the middleware's drain estimate: the 429s answered beyond the first wave, the
requests that still failed, and the total time.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_common import Cleanup, median, percentile, write_config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONCURRENCY = 1
REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"


def _listening() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    sock.set_inheritable(True)
    return sock


def server_cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in nanoseconds (schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return total


def start_uvicorn(
    cleanup: Cleanup, app: str, app_dir: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], int]:
    # --host/--port, not --fd: uvicorn wraps an inherited descriptor as AF_UNIX, so asyncio
    # would not set TCP_NODELAY on its connections and Nagle + delayed ACKs would add 40 ms.
    sock = _listening()
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            app,
            "--app-dir",
            str(app_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cleanup.popen(proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(REQUEST)
                if c.recv(1024).startswith(b"HTTP/1.1 "):
                    return proc, port
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{app} did not answer within 60 s")


async def _load(port: int, requests: int) -> list[int]:
    """``requests`` GETs over ``CONCURRENCY`` keep-alive connections; latencies in ns."""
    latencies: list[int] = []
    per_connection = requests // CONCURRENCY

    async def one_connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(per_connection):
                t0 = time.perf_counter_ns()
                writer.write(REQUEST)
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter_ns() - t0)
        finally:
            writer.close()

    await asyncio.gather(*(one_connection() for _ in range(CONCURRENCY)))
    return latencies


@dataclass
class CostResult:
    cpu_us: dict[str, list[float]] = field(default_factory=dict)  # per round, per request
    p50_us: dict[str, list[float]] = field(default_factory=dict)
    p99_us: dict[str, list[float]] = field(default_factory=dict)
    requests: int = 0


def run_asgi_cost(
    cleanup: Cleanup,
    rounds: int,
    requests: int,
    middleware_files: dict[str, str | None],
    log: object = print,
) -> CostResult:
    """``middleware_files``: label -> None (this checkout) or a file of another revision;
    the app without the middleware is measured as ``"plain"``."""
    from shm_layout import unlink_segment

    with cleanup.scope() as scope:
        directory = scope.tempdir()
        config = write_config(directory, [{"id": "bench", "maxConcurrent": 64}])
        segment = "/gwb-asgi" + os.urandom(3).hex()
        scope.push(f"segment {segment}", lambda: unlink_segment(segment))
        servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        base_env = {"BENCH_CONFIG": config, "GATEWAY_CAPACITY_SEGMENT": segment}
        servers["plain"] = start_uvicorn(scope, "asgi_bench_app:plain", HERE, base_env)
        for label, path in middleware_files.items():
            env = dict(base_env)
            if path:
                env["BENCH_MIDDLEWARE_FILE"] = path
            servers[label] = start_uvicorn(scope, "asgi_bench_app:admitted", HERE, env)
        result = CostResult(requests=requests)
        order = list(servers)
        for _, port in servers.values():  # warm-up: imports, attach, caches
            asyncio.run(_load(port, 2000))
        for r in range(rounds):
            for label in order if r % 2 == 0 else reversed(order):
                proc, port = servers[label]
                before = server_cpu_ns(proc.pid)
                latencies = asyncio.run(_load(port, requests))
                cpu = server_cpu_ns(proc.pid) - before
                result.cpu_us.setdefault(label, []).append(cpu / len(latencies) / 1e3)
                result.p50_us.setdefault(label, []).append(percentile(latencies, 50) / 1e3)
                result.p99_us.setdefault(label, []).append(percentile(latencies, 99) / 1e3)
            if callable(log):
                log(f"asgi: round {r + 1}/{rounds} done")
        return result


def cost_table_rows(result: CostResult) -> list[list[str]]:
    """Medians; ``added`` and ``p50 vs plain`` are medians of the per-round differences
    and ratios against the plain app's round beside it (paired: a shared machine's drift
    over the run cancels out)."""
    plain_cpu, plain_p50 = result.cpu_us["plain"], result.p50_us["plain"]
    rows = []
    for label in result.cpu_us:
        cpu, p50 = result.cpu_us[label], result.p50_us[label]
        added = median([c - b for c, b in zip(cpu, plain_cpu, strict=True)])
        ratio = median([p / b for p, b in zip(p50, plain_p50, strict=True)])
        rows.append(
            [
                label,
                f"{median(cpu):.1f}",
                "-" if label == "plain" else f"{added:+.1f}",
                f"{median(p50):.0f}",
                "-" if label == "plain" else f"{100 * (ratio - 1):+.1f} %",
                f"{median(result.p99_us[label]):.0f}",
            ]
        )
    return rows


# --- the openai SDK against Retry-After ------------------------------------------------
@dataclass
class RetryResult:
    label: str
    ok: int
    failed: int
    answered_429: int  # every 429 the middleware answered (first tries and retries)
    extra_429: int  # 429s answered to retries
    seconds: float
    retry_after_seen: list[int]


def run_sdk_retry(
    cleanup: Cleanup, fixed: int | None, requests: int = 80, delay: float = 0.5
) -> RetryResult:
    """One run: the example gateway with ``Retry-After`` fixed (``fixed``) or estimated."""
    import openai

    from capacity_router import SimWorker
    from shm_layout import unlink_segment

    with cleanup.scope() as scope:
        directory = Path(scope.tempdir())
        upstream = SimWorker(slots=64, openai=True, delay=delay, model="workhorse")
        upstream.start()
        scope.push("fake upstream", upstream.stop)
        config = directory / "gateway.json"
        config.write_text(
            json.dumps(
                {
                    "providers": [
                        {
                            "id": "local-inference",
                            "baseUrl": f"{upstream.url}/v1",
                            "maxConcurrent": 4,
                            "models": {"local-workhorse": "workhorse"},
                        }
                    ]
                }
            )
        )
        segment = "/gwb-retry" + os.urandom(3).hex()
        scope.push(f"segment {segment}", lambda: unlink_segment(segment))
        env = {"GATEWAY_CONFIG": str(config), "GATEWAY_CAPACITY_SEGMENT": segment}
        if fixed is not None:
            env["GATEWAY_RETRY_AFTER"] = str(fixed)
        _, port = start_uvicorn(scope, "openai_gateway:app", ROOT / "examples", env)
        base = f"http://127.0.0.1:{port}/v1"

        import httpx

        async def scenario() -> tuple[int, int, float, list[tuple[int, int]]]:
            seen: list[tuple[int, int]] = []  # (the SDK's retry number, Retry-After) per 429

            async def record(response: httpx.Response) -> None:
                if response.status_code == 429:
                    retry = int(response.request.headers.get("x-stainless-retry-count", "0"))
                    seen.append((retry, int(response.headers.get("retry-after", "0"))))

            http = httpx.AsyncClient(
                event_hooks={"response": [record]}, limits=httpx.Limits(max_connections=200)
            )
            client = openai.AsyncOpenAI(base_url=base, api_key="unused", http_client=http)
            messages = [{"role": "user", "content": "hi"}]
            # A gateway that has served for a while knows its hold times: warm it up.
            await asyncio.gather(
                *(
                    client.chat.completions.create(model="local-workhorse", messages=messages)  # type: ignore[arg-type]
                    for _ in range(4)
                )
            )
            seen.clear()
            t0 = time.monotonic()

            async def one() -> bool:
                try:
                    await client.chat.completions.create(model="local-workhorse", messages=messages)  # type: ignore[arg-type]
                    return True
                except openai.APIStatusError:
                    return False

            results = await asyncio.gather(*(one() for _ in range(requests)))
            elapsed = time.monotonic() - t0
            await client.close()
            return sum(results), requests - sum(results), elapsed, seen

        ok, failed, elapsed, seen = asyncio.run(scenario())
        return RetryResult(
            label="estimated" if fixed is None else f"fixed {fixed} s",
            ok=ok,
            failed=failed,
            answered_429=len(seen),
            extra_429=sum(1 for retry, _ in seen if retry > 0),
            seconds=elapsed,
            retry_after_seen=sorted({ra for _, ra in seen}),
        )
