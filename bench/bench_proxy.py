"""What the router's relay adds to a request and to a streamed token, beside a direct one.

One ``router simworker --openai --delay 0`` process (the upstream: it answers at once)
and one ``router serve`` process in front of it, both on loopback; the client is this
process (httpx, one request at a time). Each round measures, straight to the worker and
through the router (the order alternating between rounds): non-streamed completions of
one token, streamed completions of one token, and streamed completions of 64 tokens
(64 SSE events, each its own write on the worker). The per-token figure is the slope
``(t64 - t1) / 63`` of the streamed ones, so the request's own cost cancels out.

Both paths open one new TCP connection to the worker per request (the simulated worker
speaks HTTP/1.0 and closes each answer); the client keeps its connection to the router
alive, as a gateway does. The router's CPU comes from ``/proc/<pid>/task/*/schedstat``
(every thread) over its side of each round; it polls every 30 s, so its rounds stay out
of the figures.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_common import (
    Cleanup,
    median,
    percentile,
    proc_cpu_ns,
    wait_until,
    write_router_files,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEY = "bench-router-key"
MODEL = "bench-model"
LONG = 64  # tokens in the long streamed answer
KINDS = ("models", "plain", "stream1", "stream64")


@dataclass
class ProxyCost:
    # kind -> side -> per-round median (and 10th percentile) latency in ns;
    # kind -> per-round router CPU per request
    latency: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    fast: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    router_cpu: dict[str, list[float]] = field(default_factory=dict)
    rounds: int = 0
    requests: int = 0
    streams: int = 0


def _start(cleanup: Cleanup, args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway_capacity", "router", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
    cleanup.popen(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line:
        raise RuntimeError(f"router {args[0]} printed nothing")
    return proc, line


def _farm(cleanup: Cleanup) -> tuple[str, str, int]:
    """(worker URL, router URL, router pid)."""
    _, line = _start(
        cleanup,
        ["simworker", "--slots", "8", "--openai", "--delay", "0", "--model", MODEL],
    )
    worker_url = line.split(" on ", 1)[1].split(" ", 1)[0]
    key_file, registry = write_router_files(cleanup.tempdir(), KEY, worker_url, MODEL)
    serve = ["serve", "--workers", registry, "--key-file", key_file]
    proc, line = _start(cleanup, [*serve, "--listen", "127.0.0.1:0", "--poll", "30"])
    router_url = line.strip().removeprefix("serving ").removesuffix("/v1/capacity")
    return worker_url, router_url, proc.pid


def _body(kind: str) -> dict[str, object]:
    tokens = LONG if kind == "stream64" else 1
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": tokens,
        "stream": kind != "plain",
    }


def _one(client: httpx.Client, url: str, kind: str) -> int:
    """One request, read to its end; returns the wall time in ns."""
    if kind == "models":
        method, path, body = "GET", "/v1/models", None
    else:
        method, path, body = "POST", "/v1/chat/completions", _body(kind)
    started = time.perf_counter_ns()
    with client.stream(method, f"{url}{path}", json=body) as response:
        size = 0
        for chunk in response.iter_raw():
            size += len(chunk)
    elapsed = time.perf_counter_ns() - started
    if response.status_code != 200 or size == 0:
        raise RuntimeError(f"{url}: {kind} answered {response.status_code}, {size} bytes")
    return elapsed


def _check_stream(client: httpx.Client, url: str) -> None:
    with client.stream("POST", f"{url}/v1/chat/completions", json=_body("stream64")) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    if len(events) != LONG + 1 or events[-1] != "data: [DONE]":
        raise RuntimeError(f"{url}: {len(events)} SSE events, expected {LONG} and [DONE]")


def _client(headers: dict[str, str] | None = None) -> httpx.Client:
    # TCP_NODELAY, as asyncio sets it on the router's own sockets: httpx writes a request's
    # head and body apart, and on a kept-alive connection Nagle would hold the body back
    # for the router's delayed ACK (tens of ms that are the client's, not the relay's).
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    return httpx.Client(
        trust_env=False,
        timeout=30,
        headers=headers,
        transport=httpx.HTTPTransport(socket_options=nodelay),
    )


def run_proxy_cost(
    cleanup: Cleanup, rounds: int, requests: int, streams: int, log: Callable[[str], None]
) -> ProxyCost:
    worker_url, router_url, router_pid = _farm(cleanup)
    direct, routed = _client(), _client({"Authorization": f"Bearer {KEY}"})
    cleanup.push("http clients", lambda: (direct.close(), routed.close()))
    sides = {"direct": (direct, worker_url), "router": (routed, router_url)}
    wait_until(
        lambda: routed.get(f"{router_url}/v1/models").json()["data"] != [],
        10,
        "the router to see its worker",
    )
    for client, url in sides.values():
        _check_stream(client, url)
        for kind in KINDS:  # warm both paths (imports, connections, caches)
            for _ in range(5):
                _one(client, url, kind)
    result = ProxyCost(rounds=rounds, requests=requests, streams=streams)
    for kind in KINDS:
        result.latency[kind] = {"direct": [], "router": []}
        result.fast[kind] = {"direct": [], "router": []}
        result.router_cpu[kind] = []
    for i in range(rounds):
        log(f"proxy: round {i + 1} of {rounds}")
        order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
        for kind in KINDS:
            count = streams if kind == "stream64" else requests
            for side in order:
                client, url = sides[side]
                cpu_before = proc_cpu_ns(router_pid)
                times = [_one(client, url, kind) for _ in range(count)]
                cpu = proc_cpu_ns(router_pid) - cpu_before
                result.latency[kind][side].append(median(times))
                result.fast[kind][side].append(percentile(times, 10))
                if side == "router":
                    result.router_cpu[kind].append(cpu / count)
    return result


def _per_token(samples: list[float], ones: list[float]) -> list[float]:
    return [(long - one) / (LONG - 1) for long, one in zip(samples, ones, strict=True)]


def proxy_table_rows(r: ProxyCost, fmt_us: Callable[[float], str]) -> list[list[str]]:
    """Rows: what, direct p50, via the router p50, the router adds at p50 and at p10,
    router CPU."""
    labels = {
        "models": "GET /v1/models (the router answers it)",
        "plain": "completion, 1 token, not streamed",
        "stream1": "streamed completion, 1 token",
        "stream64": f"streamed completion, {LONG} tokens",
    }

    def added(d: list[float], p: list[float]) -> str:
        return fmt_us(median([b - a for a, b in zip(d, p, strict=True)]))

    rows = []
    for kind in KINDS:
        d, p = r.latency[kind]["direct"], r.latency[kind]["router"]
        fd, fp = r.fast[kind]["direct"], r.fast[kind]["router"]
        cpu = fmt_us(median(r.router_cpu[kind]))
        rows.append(
            [labels[kind], fmt_us(median(d)), fmt_us(median(p)), added(d, p), added(fd, fp), cpu]
        )
    d_tok = _per_token(r.latency["stream64"]["direct"], r.latency["stream1"]["direct"])
    p_tok = _per_token(r.latency["stream64"]["router"], r.latency["stream1"]["router"])
    fd_tok = _per_token(r.fast["stream64"]["direct"], r.fast["stream1"]["direct"])
    fp_tok = _per_token(r.fast["stream64"]["router"], r.fast["stream1"]["router"])
    cpu_tok = _per_token(r.router_cpu["stream64"], r.router_cpu["stream1"])
    rows.append(
        [
            f"per streamed token (slope, {LONG} vs 1)",
            fmt_us(median(d_tok)),
            fmt_us(median(p_tok)),
            added(d_tok, p_tok),
            added(fd_tok, fp_tok),
            fmt_us(median(cpu_tok)),
        ]
    )
    return rows
