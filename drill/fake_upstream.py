"""The upgrade drill's inference provider: counts the completions in flight, exactly.

    python drill/fake_upstream.py --fd N --key-file KEY --router URL [--chunk-s 0.2]

Served by uvicorn on a listening socket the drill bound on loopback (``--fd``).

- ``POST /v1/chat/completions`` (bearer = the key file): answers an SSE stream
  of ``max_tokens`` chunks, one every ``--chunk-s``, then ``data: [DONE]``. A
  request whose ``X-Request-Id`` starts with ``legacy`` is counted apart (the
  legacy generation is not admitted); a ``model`` other than ``--model``
  is answered 404. The in-flight count goes up when the
  request arrives and down before the last byte is sent (or when the client
  goes away), so a gateway that has seen the end of the stream has already
  been counted out.
- ``GET /v1/capacity``: relayed to the reference router with the same
  ``Authorization`` (the provider's ``baseUrl`` is this server, as a router in
  front of a real farm would serve both).
- ``GET /_drill/stats``: in flight, peak and totals per class, as JSON.
- ``GET /_drill/events``: every change of an in-flight count, ``[t, class, value, id, asked,
  granted]``: ``id`` numbers the request; on its arrival, ``asked``/``granted`` are the
  monotonic times of its admission grant, from the ``x-gateway-capacity-grant`` header the
  gateway forwards (null without one, and on departures).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import time
from typing import Any

import httpx
import uvicorn

Scope = dict[str, Any]


class Upstream:
    def __init__(self, key: bytes, router: str, chunk_s: float, model: str) -> None:
        self.key = key
        self.model = model
        self.router = router.rstrip("/")
        self.chunk_s = chunk_s
        self.inflight = {"admitted": 0, "legacy": 0}
        self.peak = {"admitted": 0, "legacy": 0}
        self.total = {"admitted": 0, "legacy": 0}
        self.completed = {"admitted": 0, "legacy": 0}
        self.events: list[tuple[float, str, int, int, float | None, float | None]] = []
        self.serial = 0
        self.client: httpx.AsyncClient | None = None

    def _count(
        self, kind: str, delta: int, request: int, grant: tuple[float, float] | None = None
    ) -> None:
        self.inflight[kind] += delta
        self.peak[kind] = max(self.peak[kind], self.inflight[kind])
        asked, granted = grant if grant is not None else (None, None)
        self.events.append((time.time(), kind, self.inflight[kind], request, asked, granted))

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if path == "/_drill/stats":
            doc = {
                "inflight": self.inflight,
                "peak": self.peak,
                "total": self.total,
                "completed": self.completed,
                "events": len(self.events),
            }
            await _json(send, 200, doc)
        elif path == "/_drill/events":
            await _json(send, 200, self.events)
        elif not self._authorized(headers.get("authorization", b"")):
            await _json(send, 401, {"error": {"message": "bad key", "type": "auth"}})
        elif path == "/v1/capacity":
            await self._relay(headers, send)
        elif path == "/v1/chat/completions" and scope["method"] == "POST":
            await self._complete(headers, receive, send)
        else:
            await _json(send, 404, {"error": {"message": "not found", "type": "not_found"}})

    def _authorized(self, value: bytes) -> bool:
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def _relay(self, headers: dict[str, bytes], send: Any) -> None:
        if self.client is None:
            self.client = httpx.AsyncClient(trust_env=False, timeout=2.5)
        try:
            answer = await self.client.get(
                f"{self.router}/v1/capacity",
                headers={"authorization": headers["authorization"].decode("latin-1")},
            )
        except httpx.HTTPError:
            await _json(send, 502, {"error": "router unreachable"})
            return
        await send(
            {
                "type": "http.response.start",
                "status": answer.status_code,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": answer.content})

    async def _complete(self, headers: dict[str, bytes], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request: dict[str, Any] = json.loads(body)
        if request.get("model") != self.model:  # the gateway maps its alias to the upstream id
            await _json(send, 404, {"error": {"message": "unknown model", "type": "not_found"}})
            return
        chunks = int(request.get("max_tokens", 5))
        kind = "legacy" if headers.get("x-request-id", b"").startswith(b"legacy") else "admitted"
        self.serial += 1
        serial = self.serial
        self._count(kind, +1, serial, _grant(headers.get("x-gateway-capacity-grant")))
        self.total[kind] += 1
        counted = True
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-cache"),
                    ],
                }
            )
            for i in range(chunks):
                if gone.is_set():
                    return
                chunk = {
                    "object": "chat.completion.chunk",
                    "model": request.get("model"),
                    "choices": [{"index": 0, "delta": {"content": f"t{i} "}}],
                }
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                    }
                )
                with _suppress_timeout():
                    await asyncio.wait_for(gone.wait(), self.chunk_s)
            self._count(kind, -1, serial)
            counted = False
            self.completed[kind] += 1
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            watcher.cancel()
            if counted:
                self._count(kind, -1, serial)


def _grant(value: bytes | None) -> tuple[float, float] | None:
    """(asked, granted) from the middleware's grant header (``Grant.header()``), or None."""
    if value is None:
        return None
    fields = dict(part.strip().partition("=")[::2] for part in value.decode().split(";"))
    try:
        return float(fields["asked"]), float(fields["granted"])
    except (KeyError, ValueError):
        return None


class _suppress_timeout:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return kind is TimeoutError


async def _json(send: Any, status: int, doc: Any) -> None:
    body = json.dumps(doc).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--router", required=True)
    ap.add_argument("--chunk-s", type=float, default=0.2)
    ap.add_argument("--model", default="workhorse", help="the only upstream model id served")
    args = ap.parse_args()
    with open(args.key_file, "rb") as f:
        key = f.read().strip()
    app = Upstream(key, args.router, args.chunk_s, args.model)
    uvicorn.run(app, fd=args.fd, log_level="warning", lifespan="off", access_log=False)


if __name__ == "__main__":
    main()
