"""The trivial ASGI app of ``make bench``'s ``asgi`` section, with or without the middleware.

Served by uvicorn: ``asgi_bench_app:plain`` answers ``ok`` at once; ``asgi_bench_app:admitted``
is the same app inside ``AdmissionMiddleware`` (``$BENCH_CONFIG``, provider ``bench``, whose
limit is above the load's concurrency: every request is admitted at once). With
``$BENCH_MIDDLEWARE_FILE`` the middleware class is loaded from that file instead (another
revision of ``handler_shim/asgi.py``, for a before/after figure in one run).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

BODY = b"ok\n"
HEAD = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"3")],
}


async def plain(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send(HEAD)
    await send({"type": "http.response.body", "body": BODY})


def _middleware() -> Any:
    path = os.environ.get("BENCH_MIDDLEWARE_FILE")
    if not path:
        from handler_shim.asgi import AdmissionMiddleware

        return AdmissionMiddleware
    spec = importlib.util.spec_from_file_location("bench_asgi_middleware", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AdmissionMiddleware


admitted = _middleware()(
    plain, config=os.environ.get("BENCH_CONFIG"), generation="bench", provider="bench"
)
