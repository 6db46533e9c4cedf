"""A route whose path names the model (LiteLLM's Azure- and engine-style routes, the
routes table of ``handler_shim.model_routes``) is charged its tokens too (R-T1, R-T2):
its JSON body is read for the charge alone, and a body that cannot be charged (not
JSON, larger than ``max_body``) reaches the app as before, on slots alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gwtest import publish_token_budget

from handler_shim import Admission
from handler_shim.asgi import AdmissionMiddleware
from handler_shim.model_choice import ByModel
from shm_layout.view import read_view

AZURE = "/openai/deployments/m/chat/completions"


def _chat(content: str, **fields: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


def test_r_t2_a_path_routes_body_is_charged_and_what_no_worker_holds_is_refused(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 4, "models": {"m": "m"}}]})
    publisher = Admission.attach(config=config, segment=segment_name, generation="publisher")
    publish_token_budget(publisher, limit=4, tokens=1000, per_request=300)
    seen: list[tuple[int, bytes]] = []  # tokens running, the body the app got

    async def main() -> list[tuple[int, bytes]]:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
            p1 = read_view(segment_name).provider("p1")
            assert p1 is not None
            seen.append((p1.tokens_running, body))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        mw = AdmissionMiddleware(
            app,
            config=str(config),
            segment=segment_name,
            provider=ByModel(max_body=2048),
            timeout=5.0,
        )
        answers: list[tuple[int, bytes]] = []

        async def request(*chunks: bytes) -> None:
            sent = [
                {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)
            ]

            async def receive() -> dict[str, Any]:
                if sent:
                    return sent.pop(0)
                await asyncio.sleep(30)
                return {"type": "http.disconnect"}

            status, out = 0, []

            async def send(message: dict[str, Any]) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                else:
                    out.append(message.get("body", b""))

            scope = {
                "type": "http",
                "method": "POST",
                "path": AZURE,
                "headers": [(b"content-type", b"application/json")],
                "query_string": b"api-version=2024-06-01",
            }
            await mw(scope, receive, send)
            answers.append((status, b"".join(out)))

        await request(_chat("x" * 100, max_tokens=100))  # fits
        await request(_chat("x" * 1200, max_tokens=10))  # the prompt alone is over 300
        await request(b"not json")  # reaches the app as before, uncharged
        big = _chat("y" * 3000, max_tokens=10)
        await request(big[:1500], big[1500:])  # over max_body: uncharged, passed whole
        await mw.detach()
        return answers

    try:
        answers = asyncio.run(main())
    finally:
        publisher.close()
    assert [status for status, _ in answers] == [200, 400, 200, 200]
    error = json.loads(answers[1][1])["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "300" in error["message"]
    charged, first = seen[0]
    assert 100 < charged <= 300 and first == _chat("x" * 100, max_tokens=100)
    assert seen[1] == (0, b"not json")
    assert seen[2] == (0, _chat("y" * 3000, max_tokens=10))
