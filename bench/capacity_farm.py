"""A loopback capacity router for the sidecar benchmark, in a process of its own.

    python bench/capacity_farm.py --addresses 4 --key-file KEY

Listens on one port on 127.0.0.1 .. 127.0.0.N (never beyond loopback) and
answers ``GET /v1/capacity`` (bearer checked) with a fresh, complete snapshot,
HTTP/1.1 with keep-alive, as uvicorn in front of a real farm does. ``GET /stats``
(no key) answers the number of capacity answers so far. Prints the port on its
first line; stops on SIGTERM or at the end of standard input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

MODEL = "bench-upstream"
SLOTS = 6


def capacity_body() -> bytes:
    """The farm's answer to ``GET /v1/capacity``: MODEL with SLOTS, complete, now."""
    models = [{"id": MODEL, "max_concurrent_requests": SLOTS}]
    doc = {"object": "inference_capacity", "version": 1, "complete": True, "models": models}
    return json.dumps({**doc, "observed_at": time.time()}).encode()


class Farm:
    def __init__(self, key: str) -> None:
        self.auth = f"Bearer {key}".encode()
        self.answers = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                target = lines[0].split(b" ")[1] if b" " in lines[0] else b""
                auth = b""
                for line in lines[1:]:
                    if line.lower().startswith(b"authorization:"):
                        auth = line.split(b":", 1)[1].strip()
                if target == b"/stats":
                    body = str(self.answers).encode()
                    status = b"200 OK"
                elif target != b"/v1/capacity":
                    body, status = b"", b"404 Not Found"
                elif auth != self.auth:
                    body, status = b"", b"401 Unauthorized"
                else:
                    self.answers += 1
                    status = b"200 OK"
                    body = capacity_body()
                writer.write(
                    b"HTTP/1.1 "
                    + status
                    + b"\r\nContent-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


async def main(addresses: int, key: str) -> None:
    farm = Farm(key)
    first = await asyncio.start_server(farm.serve, "127.0.0.1", 0)
    port = first.sockets[0].getsockname()[1]
    servers = [first]
    for n in range(2, addresses + 1):
        servers.append(await asyncio.start_server(farm.serve, f"127.0.0.{n}", port))
    print(port, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.read(1) else None)
    await stop.wait()
    for server in servers:
        server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--addresses", type=int, default=1)
    parser.add_argument("--key-file", required=True)
    args = parser.parse_args()
    with open(args.key_file, encoding="ascii") as f:
        secret = f.read().strip()
    asyncio.run(main(args.addresses, secret))
