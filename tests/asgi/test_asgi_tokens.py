"""The ASGI middleware charges a request its tokens (R-T1, R-T2; DESIGN.md section 6c):
the prompt's bound from the JSON body ``by_model`` read plus its ``max_tokens`` (none:
the most one request may hold), a request no worker could hold answered 400
``context_length_exceeded`` with the numbers at once, one that fits admitted with its
charge in the segment while it runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gwtest import publish_token_budget

from handler_shim import Admission
from handler_shim.asgi import AdmissionMiddleware, by_model
from handler_shim.model_choice import (
    MESSAGE_OVERHEAD,
    REQUEST_OVERHEAD,
    prompt_bound,
    request_charge,
)
from shm_layout.view import read_view


def _chat(content: str, **fields: Any) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    ).encode()


def test_r_t1_the_prompt_bound_never_counts_fewer_tokens_than_bytes() -> None:
    doc = {"messages": [{"role": "user", "content": "héllo"}], "max_tokens": 7, "n": 2}
    bound = prompt_bound(doc)
    assert bound >= len("héllo".encode()) + MESSAGE_OVERHEAD + REQUEST_OVERHEAD
    charge = request_charge(doc)
    assert (charge.prompt, charge.generated) == (bound, 14)  # n choices of max_tokens each
    assert request_charge({"prompt": "abc"}).tokens(256) == 256  # none named: the context
    assert request_charge({"prompt": "abc"}).tokens(None) == prompt_bound({"prompt": "abc"})


def test_r_t2_the_middleware_refuses_what_no_worker_holds_and_charges_what_runs(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 4, "models": {"m": "m"}}]})
    publisher = Admission.attach(config=config, segment=segment_name, generation="publisher")
    publish_token_budget(publisher, limit=4, tokens=1000, per_request=300)
    seen_running: list[int] = []

    async def main() -> list[tuple[int, bytes]]:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            p1 = read_view(segment_name).provider("p1")
            assert p1 is not None
            seen_running.append(p1.tokens_running)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        mw = AdmissionMiddleware(
            app, config=str(config), segment=segment_name, provider=by_model, timeout=5.0
        )
        answers: list[tuple[int, bytes]] = []

        async def request(body: bytes) -> None:
            sent = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if sent:
                    return sent.pop()
                await asyncio.sleep(30)
                return {"type": "http.disconnect"}

            status, chunks = 0, []

            async def send(message: dict[str, Any]) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                else:
                    chunks.append(message.get("body", b""))

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/chat/completions",
                "headers": [(b"content-type", b"application/json")],
                "query_string": b"",
            }
            await mw(scope, receive, send)
            answers.append((status, b"".join(chunks)))

        await request(_chat("x" * 100, max_tokens=100))  # fits: 100 + overheads + 100
        await request(_chat("x" * 400, max_tokens=10))  # the prompt alone is over 300
        await request(_chat("short"))  # no max_tokens: charged the context, 300
        await mw.detach()
        return answers

    try:
        answers = asyncio.run(main())
    finally:
        publisher.close()
    assert [status for status, _ in answers] == [200, 400, 200]
    error = json.loads(answers[1][1])["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "300" in error["message"] and "tokens" in error["message"]
    body = _chat("x" * 100, max_tokens=100)
    expected = prompt_bound(json.loads(body)) + 100
    assert seen_running == [expected, 300]  # each charge in the segment while it ran
