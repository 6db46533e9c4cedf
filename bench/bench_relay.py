"""The relay at a farm's load, beside nginx, in one run (``make bench``, section ``relay``).

One upstream process speaks keep-alive HTTP/1.1 as an inference server does: a
streamed completion is one chunk per token, tokens ``GAP_MS`` apart (40 tok/s), and
a non-streamed one answers at once. In front of it, side by side: ``router serve``
(registry: that upstream, its slots read from ``/props``) and nginx (one worker,
upstream keepalive, ``proxy_buffering off``: how nginx is set up for SSE). The
client is this process (asyncio, uvloop where installed, one kept-alive connection
per concurrent stream).

- **per request**: at ``c`` = 1, 16 and 64 clients, non-streamed completions back to
  back for a while, sent by ``wrk`` (a C client, so that the client's own CPU takes
  little from the proxies on a small machine; this process's asyncio client where wrk
  is not installed); the proxy's CPU (schedstat of every thread of every process of
  it, less its CPU at rest over the same time: the router's poller) over the requests
  it relayed, and the latency p50 as the client saw it.
- **the stream ladder**: ``c`` = 1, 16..256 clients each run 40-token streams back to
  back; per rung: streams done, errors, first-token p99 (from the request's start),
  token lateness p99 (a gap between two tokens beyond ``GAP_MS``), and the proxy's
  CPU per token (its CPU less its CPU at rest and the per-request cost of the streams,
  over the tokens).
  A rung is carried with no error, lateness p99 < 50 ms and first token p99 < 500 ms.

Run alone: ``python bench/bench_relay.py [--quick]``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_common import (  # noqa: E402
    Cleanup,
    percentile,
    proc_cpu_ns,
    wait_until,
    write_router_files,
)

KEY = "bench-relay-key"
MODEL = "bench-model"
GAP_MS = 25
TOKENS = 40
LADDER = (1, 16, 32, 64, 128, 256)
PER_REQUEST = (1, 16, 64)


# -- the upstream: keep-alive HTTP/1.1, tokens spaced as an LLM emits them ----------


class _Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].split(b"\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            method, path = head[0].split(b" ")[:2]
            self._answer(method, path, body)

    def _send(self, status: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )

    def _answer(self, method: bytes, path: bytes, body: bytes) -> None:
        if method == b"GET":
            if path == b"/props":
                self._send(b"200 OK", b'{"total_slots": 1024}')
            elif path == b"/health":
                self._send(b"200 OK", b'{"status": "ok"}')
            else:
                self._send(b"404 Not Found", b"{}")
            return
        request = json.loads(body)
        if not request.get("stream"):
            self._send(b"200 OK", b'{"choices": [{"message": {"content": "t0"}}]}')
            return
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        self.busy = True
        self._token(0, int(request.get("max_tokens", TOKENS)))

    def _token(self, i: int, n: int) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if i == n:
            event = b"data: [DONE]\n\n"
            transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
            self.busy = False
            self._next()
            return
        event = b'data: {"choices": [{"delta": {"content": "t%d "}}]}\n\n' % i
        transport.write(b"%x\r\n%s\r\n" % (len(event), event))
        asyncio.get_running_loop().call_later(GAP_MS / 1000, self._token, i + 1, n)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve_upstream() -> None:
    loop = _new_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    loop.run_until_complete(loop.create_server(_Upstream, sock=sock))
    print(sock.getsockname()[1], flush=True)
    loop.run_forever()


# -- the targets -------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: tuple[str, int]
    pids: Callable[[], list[int]]
    auth: bytes = b""


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _start_upstream(cleanup: Cleanup) -> int:
    proc = subprocess.Popen(
        [sys.executable, __file__, "upstream"], stdout=subprocess.PIPE, cwd=ROOT
    )
    cleanup.popen(proc)
    assert proc.stdout is not None
    return int(proc.stdout.readline())


def _start_router(cleanup: Cleanup, upstream: int) -> Target:
    upstream_url = f"http://127.0.0.1:{upstream}"
    key_file, registry = write_router_files(cleanup.tempdir(), KEY, upstream_url, MODEL)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway_capacity", "router", "serve", "--workers", registry,
         "--key-file", key_file, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    cleanup.popen(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    port = int(line.strip().removesuffix("/v1/capacity").rsplit(":", 1)[1])
    return Target("router", ("127.0.0.1", port), lambda: [proc.pid], b"Bearer " + KEY.encode())


NGINX_CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream worker {{ server 127.0.0.1:{upstream}; keepalive 512; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://worker;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


def _start_nginx(cleanup: Cleanup, upstream: int) -> Target | None:
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None
    )
    if nginx is None:
        return None
    directory = cleanup.tempdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = os.path.join(directory, "nginx.conf")
    with open(conf, "w") as f:
        f.write(NGINX_CONF.format(dir=directory, upstream=upstream, port=port))
    proc = subprocess.Popen(
        [nginx, "-p", directory, "-c", conf, "-g", "daemon off;"], stderr=subprocess.DEVNULL
    )
    cleanup.popen(proc)

    def ready() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(ready, 10, "nginx to listen")
    return Target("nginx", ("127.0.0.1", port), lambda: [proc.pid, *_children(proc.pid)])


# -- the client ----------------------------------------------------------------------


@dataclass
class Rung:
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    first: list[float] = field(default_factory=list)
    late: list[float] = field(default_factory=list)
    cpu_ns: int = 0
    wall_s: float = 0.0
    capacity_reads: int = 0
    capacity_wrong: int = 0  # failed, incomplete, or not the worker's 1024 slots
    latency: list[float] = field(default_factory=list)  # a non-streamed request's
    idle_ns: int = 0  # the proxy's CPU at rest over the rung, taken out of cpu_ns
    error_note: str = ""  # what wrk said of its errors
    p50: float | None = None  # as wrk says it

    def latency_p50(self) -> float:
        return self.p50 if self.p50 is not None else percentile(self.latency, 50)


async def _client(target: Target, stream: bool, until: float, rung: Rung) -> None:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "max_tokens": TOKENS, "stream": stream}
    ).encode()  # fmt: skip
    auth = b"authorization: " + target.auth + b"\r\n" if target.auth else b""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        + auth
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(*target.url)
            assert reader is not None
            started = loop.time()
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head[:40])
            if not stream:
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                rung.latency.append(loop.time() - started)
                rung.requests += 1
                continue
            last = None
            tokens = 0
            done = False
            tail = b""
            while True:
                data = await asyncio.wait_for(reader.read(65536), 10)
                if not data:
                    raise RuntimeError("closed mid-stream")
                now = loop.time()
                n = data.count(b'data: {"')
                if n:
                    if last is None:
                        rung.first.append(now - started)
                    else:
                        rung.late.append(max(0.0, now - last - GAP_MS / 1000))
                    last = now
                    tokens += n
                tail = (tail + data)[-64:]
                done = done or b"[DONE]" in tail
                if done and tail.endswith(b"\r\n0\r\n\r\n"):  # the last chunk, read
                    break
            rung.tokens += tokens
            rung.requests += 1
        except Exception:
            rung.errors += 1
            if writer is not None:
                writer.close()
            reader = writer = None
            await asyncio.sleep(0.05)
    if writer is not None:
        writer.close()


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
{auth}
"""


def _wrk_seconds(text: str) -> float:
    """``430.00us``, ``1.20ms``, ``2.00s`` as wrk prints a latency."""
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(unit):
            return float(text.removesuffix(unit)) * scale
    raise ValueError(text)


def run_wrk(target: Target, clients: int, seconds: float, directory: str) -> Rung | None:
    """Non-streamed completions from ``wrk`` (None where it is not installed): the
    requests, errors (socket errors and non-2xx answers), the latency p50, and the
    proxy's CPU over them."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS}
    )
    auth = f'wrk.headers["Authorization"] = "{target.auth.decode()}"' if target.auth else ""
    script = os.path.join(directory, f"post-{target.name}.lua")
    with open(script, "w") as f:
        f.write(WRK_SCRIPT.format(body=body, auth=auth))
    host, port = target.url
    rate = idle_rate(target)
    before, started = _cpu(target), time.monotonic()
    done = subprocess.run(
        [wrk, "-t1", f"-c{clients}", f"-d{seconds:g}s", "--timeout", "10s", "--latency",
         "-s", script, f"http://{host}:{port}/v1/chat/completions"],
        capture_output=True, text=True, timeout=seconds + 30,
    )  # fmt: skip
    rung = Rung(cpu_ns=_cpu(target) - before, wall_s=time.monotonic() - started)
    _net(rung, rate)
    for line in done.stdout.splitlines():
        words = line.split()
        if "requests in" in line:
            rung.requests = int(words[0])
        elif words[:1] == ["50%"]:
            rung.p50 = _wrk_seconds(words[1])
        elif line.strip().startswith("Non-2xx"):
            rung.errors += int(words[-1])
            rung.error_note += line.strip() + " "
        elif line.strip().startswith("Socket errors"):
            rung.errors += sum(int(w.strip(",")) for w in words[3::2])
            rung.error_note += line.strip() + " "
    return rung


def _cpu(target: Target) -> int:
    return sum(proc_cpu_ns(pid) for pid in target.pids())


IDLE_S = 1.0


def idle_rate(target: Target) -> float:
    """The proxy's CPU a second with no traffic (the router's poller reads the worker
    every second; nginx: nothing), taken just before a rung: it is not the relay's cost,
    so a rung's CPU is counted without it (on a busy machine a rung relays few requests,
    and the poller's share of each would swamp the figure)."""
    before = _cpu(target)
    time.sleep(IDLE_S)
    return (_cpu(target) - before) / IDLE_S


def _net(rung: Rung, rate: float) -> None:
    rung.idle_ns = int(rate * rung.wall_s)
    rung.cpu_ns = max(0, rung.cpu_ns - rung.idle_ns)


def _watch_capacity(target: Target, rung: Rung, stop: threading.Event) -> None:
    """The router's /v1/capacity every 0.5 s while its relay is loaded: the number the
    gateways admit against must stay the worker's."""
    while not stop.wait(0.5):
        rung.capacity_reads += 1
        try:
            conn = http.client.HTTPConnection(*target.url, timeout=5)
            conn.request("GET", "/v1/capacity", headers={"Authorization": target.auth.decode()})
            answer = json.loads(conn.getresponse().read())
            conn.close()
            ok = answer["complete"] and answer["models"] == [
                {"id": MODEL, "max_concurrent_requests": 1024}
            ]
        except (OSError, ValueError, KeyError):
            ok = False
        rung.capacity_wrong += not ok


def run_rung(target: Target, clients: int, stream: bool, seconds: float) -> Rung:
    rung = Rung()
    stop = threading.Event()
    watch = None
    if target.name == "router":
        watch = threading.Thread(target=_watch_capacity, args=(target, rung, stop))
        watch.start()

    async def main() -> None:
        until = asyncio.get_running_loop().time() + seconds
        await asyncio.gather(*(_client(target, stream, until, rung) for _ in range(clients)))

    rate = idle_rate(target)
    before, started = _cpu(target), time.monotonic()
    loop = _new_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    rung.cpu_ns, rung.wall_s = _cpu(target) - before, time.monotonic() - started
    _net(rung, rate)
    stop.set()
    if watch is not None:
        watch.join()
    return rung


@dataclass
class RelayBench:
    per_request_ns: dict[str, float] = field(default_factory=dict)  # at 16 clients
    per_request: dict[str, dict[int, Rung]] = field(default_factory=dict)
    client: str = "wrk"
    ladder: dict[str, dict[int, Rung]] = field(default_factory=dict)
    per_token_ns: dict[str, dict[int, float]] = field(default_factory=dict)


def run_relay(cleanup: Cleanup, log: Callable[[str], None], quick: bool = False) -> RelayBench:
    upstream = _start_upstream(cleanup)
    targets = [_start_router(cleanup, upstream)]
    nginx = _start_nginx(cleanup, upstream)
    if nginx is not None:
        targets.append(nginx)
    else:
        log("relay: nginx is not installed (scripts/ensure-tools --bench): router alone")
    time.sleep(2.5)  # the router's first rounds see the upstream
    result = RelayBench()
    seconds = 2.0 if quick else 6.0
    directory = cleanup.tempdir()
    for target in targets:
        run_rung(target, 4, False, 0.5)  # warm
    for clients in PER_REQUEST:
        for target in targets:
            rung = run_wrk(target, clients, seconds / 2, directory)
            if rung is None:
                result.client = "asyncio"
                rung = run_rung(target, clients, False, seconds / 2)
            result.per_request.setdefault(target.name, {})[clients] = rung
            log(
                f"relay: {target.name} c={clients} ({result.client}): {rung.requests} "
                f"requests, {rung.errors} errors, p50 {rung.latency_p50() * 1000:.2f} ms, "
                f"{rung.cpu_ns / max(1, rung.requests) / 1000:.0f} us CPU a request"
                + (f" ({rung.error_note.strip()})" if rung.error_note else "")
            )
    for name, rungs in result.per_request.items():
        result.per_request_ns[name] = rungs[16].cpu_ns / max(1, rungs[16].requests)
    ladder = (1, 16, 64) if quick else LADDER
    for i, clients in enumerate(ladder):
        order = targets if i % 2 == 0 else targets[::-1]
        for target in order:
            rung = run_rung(target, clients, True, seconds)
            result.ladder.setdefault(target.name, {})[clients] = rung
            request_cost = rung.requests * result.per_request_ns[target.name]
            result.per_token_ns.setdefault(target.name, {})[clients] = max(
                0.0, (rung.cpu_ns - request_cost) / max(1, rung.tokens)
            )
            log(
                f"relay: {target.name} c={clients}: {rung.requests} streams, "
                f"capacity right {rung.capacity_reads - rung.capacity_wrong}"
                f" of {rung.capacity_reads}, "
                f"{rung.errors} errors, first p99 {percentile(rung.first, 99) * 1000:.0f} ms, "
                f"late p99 {percentile(rung.late, 99) * 1000:.1f} ms"
            )
    return result


def carried(rung: Rung) -> bool:
    return (
        rung.errors == 0
        and rung.requests > 0
        and percentile(rung.late, 99) < 0.050
        and percentile(rung.first, 99) < 0.500
    )


def relay_tables(r: RelayBench) -> str:
    names = list(r.ladder)
    columns = [f"{n}: streams, errors, first p99 ms, late p99 ms, CPU us/token" for n in names]
    columns.append("router's /v1/capacity reads the worker's 1024, complete")
    lines = ["| streams at 40 tok/s | " + " | ".join(columns) + " |"]
    lines.append("|---" * (len(names) + 2) + "|")
    for clients in next(iter(r.ladder.values())):
        cells = []
        for name in names:
            rung = r.ladder[name][clients]
            cells.append(
                f"{rung.requests}, {rung.errors}, {percentile(rung.first, 99) * 1000:.0f}, "
                f"{percentile(rung.late, 99) * 1000:.1f}, "
                f"{r.per_token_ns[name][clients] / 1000:.1f}"
                + ("" if carried(rung) else " (not carried)")
            )
        watched = r.ladder["router"][clients]
        cells.append(
            f"{watched.capacity_reads - watched.capacity_wrong} of {watched.capacity_reads}"
        )
        lines.append(f"| {clients} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "| proxy CPU | " + " | ".join(names) + (" | router / nginx |" if "nginx" in names else " |")
    )
    lines.append("|---" * (len(names) + 1 + ("nginx" in names)) + "|")
    for clients in PER_REQUEST:
        rungs = {n: r.per_request[n][clients] for n in names}
        cost = {n: rung.cpu_ns / max(1, rung.requests) for n, rung in rungs.items()}
        row = [
            f"{cost[n] / 1000:.0f} us (p50 {rungs[n].latency_p50() * 1000:.2f} ms, "
            f"{rungs[n].requests} requests, {rungs[n].errors} errors)"
            for n in names
        ]
        if "nginx" in names:
            row.append(f"{cost['router'] / max(1.0, cost['nginx']):.1f}x")
        lines.append(
            f"| per request, {clients} clients, not streamed ({r.client}) | "
            + " | ".join(row)
            + " |"
        )
    for clients in next(iter(r.ladder.values())):
        row = [f"{r.per_token_ns[n][clients] / 1000:.1f} us" for n in names]
        if "nginx" in names and r.per_token_ns["nginx"][clients] > 0:
            row.append(
                f"{r.per_token_ns['router'][clients] / r.per_token_ns['nginx'][clients]:.1f}x"
            )
        elif "nginx" in names:
            row.append("-")
        lines.append(f"| per token, {clients} streams | " + " | ".join(row) + " |")
    for name in names:
        rungs = [*r.per_request[name].values(), *r.ladder[name].values()]
        at_rest = sum(x.idle_ns for x in rungs) / max(1e-9, sum(x.wall_s for x in rungs))
        lines.append(
            f"({name} at rest: {at_rest / 1e6:.1f} ms of CPU a second, taken out of its figures)"
        )
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["upstream"]:
        serve_upstream()
        return
    with Cleanup().scope() as cleanup:
        result = run_relay(cleanup, lambda m: print(m, file=sys.stderr), "--quick" in sys.argv)
        print(relay_tables(result))


if __name__ == "__main__":
    main()
