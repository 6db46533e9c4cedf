"""The ASGI middleware takes a request's admission class from a header, a path prefix or
the caller's key (R-A22), and an interactive request is admitted at once while batch
requests wait behind the interactive reserve (R-A18)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from handler_shim.asgi import AdmissionMiddleware, ClassMap

CLASSES = ClassMap(
    header="x-admission-class",
    paths={"/batch/": "batch", "/batch/urgent/": "interactive"},
    keys={"sk-chat": "interactive"},
)


def _scope(path: str = "/v1/chat", **headers: str) -> dict[str, Any]:
    raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "method": "POST", "path": path, "headers": raw}


def test_r_a22_a_class_map_reads_the_header_then_the_path_then_the_key() -> None:
    assert CLASSES(_scope(x_admission_class="batch", authorization="Bearer sk-chat")) == "batch"
    assert CLASSES(_scope("/batch/urgent/x")) == "interactive"  # the longest prefix
    assert CLASSES(_scope("/batch/x", authorization="Bearer sk-chat")) == "batch"
    assert CLASSES(_scope(authorization="Bearer sk-chat")) == "interactive"
    assert CLASSES(_scope(x_api_key="sk-chat")) == "interactive"
    assert CLASSES(_scope(authorization="Bearer sk-other")) is None  # the default class
    assert "sk-chat" not in repr(CLASSES)


def test_r_a18_r_a22_an_interactive_request_passes_batch_waiters(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    classes = [{"name": "interactive", "reserve": 1}, {"name": "batch"}]
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 2, "classes": classes}]})
    entered: list[str] = []

    async def main() -> list[int]:
        done = asyncio.Event()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            entered.append(scope["path"])
            await done.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        mw = AdmissionMiddleware(
            app,
            config=str(config),
            segment=segment_name,
            provider="p1",
            admission_class=CLASSES,
            timeout=10.0,
        )
        statuses: list[int] = []

        async def request(scope: dict[str, Any]) -> None:
            async def receive() -> dict[str, Any]:
                await asyncio.sleep(30)
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            await mw(scope, receive, send)

        tasks = [asyncio.ensure_future(request(_scope(f"/batch/{i}"))) for i in range(2)]
        await asyncio.sleep(0.3)
        assert entered == ["/batch/0"]  # the second batch request waits behind the reserve
        tasks.append(asyncio.ensure_future(request(_scope(authorization="Bearer sk-chat"))))
        await asyncio.sleep(0.3)
        assert entered == ["/batch/0", "/v1/chat"]  # admitted at once
        done.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await mw.detach()
        return statuses

    assert asyncio.run(main()) == [200, 200, 200]
    assert sorted(entered) == ["/batch/0", "/batch/1", "/v1/chat"]
    assert json.loads(config.read_text())["providers"][0]["classes"] == classes  # read only
