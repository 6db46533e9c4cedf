"""Loopback HTTP servers that misbehave on purpose, for the probe tests.

Raw asyncio servers: a well-behaved HTTP framework cannot send a wrong
Content-Length, drip a body, or keep streaming past 64 KiB. Each server binds
127.0.0.1 or ::1 on port 0, records every request it receives (so a test can
assert that a server received nothing), and hands the request to a handler
coroutine that writes whatever raw bytes it likes.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names


Handler = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawServer:
    handler: Handler
    host: str = "127.0.0.1"
    ssl_context: ssl.SSLContext | None = None
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    port: int = 0
    _server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, self.host, 0, ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        # close_clients exists from 3.13; on 3.11 closing the listener is enough here
        await asyncio.sleep(0)

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        request = Request(method, target, headers)
        self.requests.append(request)
        try:
            await self.handler(request, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def response(
    status: int,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    *,
    content_length: bool = True,
) -> bytes:
    lines = [f"HTTP/1.1 {status} X"]
    all_headers = {"Content-Type": "application/json", "Connection": "close"}
    all_headers.update(headers or {})
    if content_length and "Content-Length" not in all_headers:
        all_headers["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in all_headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def fixed(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> Handler:
    async def handler(_req: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(response(status, body, headers))
        await writer.drain()

    return handler


def snapshot(
    now: float,
    models: list[dict[str, Any]] | None = None,
    *,
    complete: Any = True,
    **overrides: Any,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "object": "inference_capacity",
        "version": 1,
        "complete": complete,
        "observed_at": now,
        "models": models
        if models is not None
        else [{"id": "workhorse", "max_concurrent_requests": 20}],
    }
    doc.update(overrides)
    return doc


def body_of(doc: Any) -> bytes:
    return json.dumps(doc).encode()


class FakeLocalAPI:
    """Answers ``GET /localapi/v0/whois?addr=IP`` like tailscaled: 200 + JSON for peers,
    404 otherwise, 403 for a wrong Host header."""

    def __init__(self, path: Path, peers: dict[str, str], status: int | None = None) -> None:
        self.path = path
        self.peers = peers
        self.status = status
        self.requests: list[tuple[str, str]] = []  # (target, host header)
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeLocalAPI:
        self._server = await asyncio.start_unix_server(self._serve, str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        target = head[0].split(" ")[1]
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)
        }
        host = headers.get("host", "")
        self.requests.append((target, host))
        url = urlsplit(target)
        addr_port = parse_qs(url.query).get("addr", [""])[0]
        # like tailscaled's netip.ParseAddrPort (older versions accept nothing else)
        addr, sep, port = addr_port.rpartition(":")
        addr = addr.removeprefix("[").removesuffix("]")
        if host not in ("", "local-tailscaled.sock"):
            status, body = 403, b"invalid localapi request\n"
        elif self.status is not None:
            status, body = self.status, b"denied\n"
        elif url.path != "/localapi/v0/whois":
            status, body = 404, b"404 page not found\n"
        elif not sep or not port.isdigit():
            status, body = 400, b"invalid 'addr' parameter\n"
        elif addr in self.peers:
            status = 200
            body = json.dumps(
                {
                    "Node": {"Name": self.peers[addr] + ".", "Addresses": [addr + "/32"]},
                    "UserProfile": {"LoginName": "ops@example.com"},
                }
            ).encode()
        else:
            status, body = 404, f"no match for IP:port {addr}\n".encode()
        status_head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n"
        status_head += "Connection: close\r\n\r\n"
        writer.write(status_head.encode() + body)
        await writer.drain()
        writer.close()
