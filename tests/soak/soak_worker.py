"""One handler process of the chaos soak (driven by ``tests/soak/soak.py``).

    python tests/soak/soak_worker.py --segment S --gen G --upstream URL --state FILE
        [--clients N] [--hammer] [--seed N]

``--clients`` threads loop until the driver creates ``FILE.stop``: each picks a
provider, the blocking or the async form, a short or a long request and a
timeout, and admits through the public API only. Inside the slot it makes one
real HTTP request to the driver's upstream server, which counts requests in
flight; the request carries when the slot was asked for and when it was entered,
so the upstream can tell which limit was in force at the admission.

``--hammer`` clients hold empty slots back to back and make no request: they
keep the segment lock busy so that the driver's kills land inside it.

``FILE`` is a small shared file: per client its phase (0 idle, 1 arriving or
waiting, 2 running) and per worker the outcome counters. Every write goes
straight to the page cache, so the counts survive a SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import mmap
import os
import random
import struct
import sys
import threading
import time
import traceback
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from handler_shim import Admission, AdmissionTimeout, QueueFull

PROVIDERS = ("p1", "p2")  # p1 follows discovery, p2 is static
MAX_CLIENTS = 8
# counters, in this order, after the MAX_CLIENTS phase slots
COUNTERS = ("asked", "entered", "completed", "queue_full", "timeout", "upstream_error", "error")
SLOTS = MAX_CLIENTS + len(COUNTERS)
STATE_SIZE = 8 * SLOTS
IDLE, ARRIVING, RUNNING = 0, 1, 2


class State:
    """The shared file: phases and counters as int64s (one writer per slot)."""

    def __init__(self, path: str) -> None:
        with open(path, "r+b") as f:
            self.buf = mmap.mmap(f.fileno(), STATE_SIZE)
        self._lock = threading.Lock()

    def phase(self, client: int, value: int) -> None:
        struct.pack_into("q", self.buf, 8 * client, value)

    def count(self, name: str) -> None:
        off = 8 * (MAX_CLIENTS + COUNTERS.index(name))
        with self._lock:
            struct.pack_into("q", self.buf, off, struct.unpack_from("q", self.buf, off)[0] + 1)


def read_state(path: str) -> tuple[list[int], dict[str, int]]:
    """(phases, counters) of a worker's state file; readable at any time."""
    with open(path, "rb") as f:
        data = f.read(STATE_SIZE).ljust(STATE_SIZE, b"\0")
    values = struct.unpack(f"{SLOTS}q", data)
    return list(values[:MAX_CLIENTS]), dict(zip(COUNTERS, values[MAX_CLIENTS:], strict=True))


def upstream_call(url: str, provider: str, asked: float, entered: float, hold_ms: int) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        query = (
            f"/work?provider={provider}&pid={os.getpid()}&asked={asked!r}"
            f"&entered={entered!r}&hold_ms={hold_ms}"
        )
        conn.request("GET", query)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--segment", required=True)
    ap.add_argument("--gen", required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--hammer", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    clients = min(args.clients, MAX_CLIENTS)
    state = State(args.state)
    stop_file = args.state + ".stop"
    adm = Admission.attach(segment=args.segment, generation=args.gen)

    parent = os.getppid()

    def stopping() -> bool:
        # the driver asks by creating the stop file; a driver that died asks nothing
        return os.path.exists(stop_file) or os.getppid() != parent

    def arrive(client: int, rng: random.Random) -> tuple[str, float, int, float]:
        """The client's next request, counted as asked: (provider, timeout, hold ms, asked at)."""
        provider = rng.choice(PROVIDERS)
        timeout = rng.uniform(0.2, 3.0)
        hold_ms = rng.randint(300, 1500) if rng.random() < 0.2 else rng.randint(2, 60)
        state.phase(client, ARRIVING)
        state.count("asked")
        return provider, timeout, hold_ms, time.time()

    def body(client: int, provider: str, asked: float, hold_ms: int) -> None:
        entered = time.time()
        state.phase(client, RUNNING)
        state.count("entered")
        if args.hammer:
            return
        status = upstream_call(args.upstream, provider, asked, entered, hold_ms)
        state.count("completed" if status == 200 else "upstream_error")

    def outcome(client: int, exc: BaseException | None) -> None:
        state.phase(client, IDLE)
        if exc is None:
            return
        if isinstance(exc, QueueFull):
            state.count("queue_full")
        elif isinstance(exc, AdmissionTimeout):
            state.count("timeout")
        else:
            state.count("error")
            print(f"client {client}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)

    def blocking_client(client: int) -> None:
        rng = random.Random(args.seed * 100 + client)
        while not stopping():
            provider, timeout, hold_ms, asked = arrive(client, rng)
            try:
                with adm.slot_blocking(provider, timeout=timeout):
                    body(client, provider, asked, hold_ms)
                outcome(client, None)
            except Exception as exc:
                outcome(client, exc)
                if isinstance(exc, QueueFull):
                    time.sleep(rng.uniform(0.01, 0.1))

    async def async_client(client: int) -> None:
        rng = random.Random(args.seed * 100 + client)
        loop = asyncio.get_running_loop()
        while not stopping():
            provider, timeout, hold_ms, asked = arrive(client, rng)
            try:
                async with adm.slot(provider, timeout=timeout):
                    await loop.run_in_executor(None, body, client, provider, asked, hold_ms)
                outcome(client, None)
            except Exception as exc:
                outcome(client, exc)
                if isinstance(exc, QueueFull):
                    await asyncio.sleep(rng.uniform(0.01, 0.1))

    async def async_clients(first: int, count: int) -> None:
        await asyncio.gather(*(async_client(first + i) for i in range(count)))

    # about a third of the clients use the async form, on one event loop
    n_async = clients // 3 if not args.hammer else 0
    threads = [
        threading.Thread(target=blocking_client, args=(i,)) for i in range(clients - n_async)
    ]
    if n_async:
        threads.append(
            threading.Thread(target=lambda: asyncio.run(async_clients(clients - n_async, n_async)))
        )
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    adm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
