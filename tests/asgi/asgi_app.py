"""A plain ASGI app behind ``AdmissionMiddleware``, served by real uvicorn/gunicorn in tests.

Settings come from the environment (read when the module is imported, in the
server process): ``GWT_CONFIG``, ``GWT_SEGMENT``, ``GWT_TIMEOUT`` (seconds),
``GWT_RELEASE_DIR``; the generation label is ``$GWT_GENERATION`` read at
attach time, so a gunicorn ``HUP`` that changes the environment relabels the
new workers even with ``--preload``.

Routes:

- ``GET /v1/hold?name=N`` (admitted, provider ``p1``): sends the head and a
  first line ``admitted <pid>``, then holds until ``$GWT_RELEASE_DIR/N`` or
  ``$GWT_RELEASE_DIR/all`` exists, then ends with ``done``. A client that goes
  away ends it early (as Starlette's streaming responses do). A ``POST`` reads
  its whole body first and sends ``body <sha256> <length>`` after that first line.
  With ``GWT_BY_MODEL=1`` the provider is ``by_model`` (the body's ``model``).
- ``POST /deployments/{model}/hold?name=N``: the same. With ``GWT_BY_MODEL=table`` the
  provider is a ``ByModel`` whose table is :data:`TABLE` (this route carries the model
  in its path; ``/v1/hold`` in its query string or body), with ``$GWT_BY_MODEL_DEFAULT``
  as its default.
- ``GET /health`` (not admitted): ``ok``.
- websocket ``/ws`` (not admitted): accepts and closes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from handler_shim.asgi import AdmissionMiddleware, ByModel, ProviderChoice, by_model
from handler_shim.model_routes import route

TABLE = (route("/deployments/{model:path}/hold", "model"), route("/v1/hold", query_model="model"))

RELEASE_DIR = Path(os.environ.get("GWT_RELEASE_DIR", "/nonexistent"))


async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})
        return
    path = scope["path"]
    if path == "/health":
        await _whole(send, 200, b"ok\n")
    elif path == "/v1/hold" or (path.startswith("/deployments/") and path.endswith("/hold")):
        query = parse_qs(scope.get("query_string", b"").decode())
        name = query.get("name", ["-"])[0]
        body = None
        if scope["method"] == "POST":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        await _hold(name, receive, send, body)
    else:
        await _whole(send, 404, b"not found\n")


async def _whole(send: Any, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _hold(name: str, receive: Any, send: Any, body: bytes | None) -> None:
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.create_task(watch())
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send(
        {
            "type": "http.response.body",
            "body": f"admitted {os.getpid()}\n".encode(),
            "more_body": True,
        }
    )
    if body is not None:
        digest = hashlib.sha256(body).hexdigest()
        line = f"body {digest} {len(body)}\n".encode()
        await send({"type": "http.response.body", "body": line, "more_body": True})
    while not gone.is_set():
        if (RELEASE_DIR / name).exists() or (RELEASE_DIR / "all").exists():
            await send({"type": "http.response.body", "body": b"done\n"})
            break
        await asyncio.sleep(0.02)
    watcher.cancel()


def _provider(scope: dict[str, Any]) -> str | None:
    return "p1" if scope["path"].startswith("/v1/") else None


def _choice() -> ProviderChoice:
    mode = os.environ.get("GWT_BY_MODEL")
    if mode == "table":
        return ByModel(routes=TABLE, default=os.environ.get("GWT_BY_MODEL_DEFAULT") or None)
    return by_model if mode == "1" else _provider


app = AdmissionMiddleware(
    inner,
    config=os.environ.get("GWT_CONFIG") or None,
    segment=os.environ.get("GWT_SEGMENT") or None,
    generation=lambda: os.environ.get("GWT_GENERATION", "asgi-test"),
    provider=_choice(),
    timeout=float(os.environ.get("GWT_TIMEOUT", "30")),
)
