"""The ASGI middleware charges a request its tokens (R-T1, R-T2; DESIGN.md section 6c):
the prompt's estimate (capacity_contract.tokens) from the JSON body ``by_model`` read plus
its ``max_tokens`` (none:
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

from capacity_contract.tokens import (
    MESSAGE_OVERHEAD,
    REQUEST_OVERHEAD,
    prompt_tokens,
    request_charge,
    text_bytes,
    text_tokens,
)
from handler_shim import Admission
from handler_shim.asgi import AdmissionMiddleware, by_model
from shm_layout.view import read_view


def _chat(content: str, **fields: Any) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    ).encode()


def test_r_t1_the_estimate_counts_letters_by_four_and_the_rest_at_their_most() -> None:
    cases = {
        "the": 1,  # a run of letters: one token a four, rounded up
        " the": 1,  # a space before a word joins it
        "router": 2,
        "reconcile": 3,
        "internationalization": 14,  # no word: a letter a token past the 8th
        "HTTPServer": 4 + 4,  # 2 + 2 past the 8th; the capitals after a letter: 4 more
        "AAAAA": 5,  # 2 + 4 capitals, but never more than a token a byte
        "12345": 5,  # a digit, a punctuation mark, a newline: one each
        "a, b.\n": 5,
        "    return x": 6,  # three spaces of the indent, "retu", "rn", " x"
        "x  ": 3,  # a space no letter follows is a token
        "日本": 6,  # outside ASCII: a token a UTF-8 byte
        "🙂": 4,
        "héllo": 4,  # "h", é's two bytes, "llo"
        "": 0,
    }
    assert {text: text_tokens(text) for text in cases} == cases


def test_r_t1_the_estimate_never_exceeds_a_token_a_byte() -> None:
    for text in ("a" * 1000, "日本語 " * 50, "\ud800 lone", "x = [1, 2]\n" * 30, "🙂" * 9):
        assert 0 < text_tokens(text) <= text_bytes(text)


def test_r_t1_the_prompt_is_every_text_the_template_renders_plus_its_overheads() -> None:
    doc = {"messages": [{"role": "user", "content": "héllo"}], "max_tokens": 7, "n": 2}
    estimate = prompt_tokens(doc)
    assert estimate == text_tokens("héllo") + MESSAGE_OVERHEAD + REQUEST_OVERHEAD
    charge = request_charge(doc)
    assert (charge.prompt, charge.generated) == (estimate, 14)  # n choices of max_tokens each
    assert request_charge({"prompt": "abc"}).tokens(256) == 256  # none named: the context
    assert request_charge({"prompt": "abc"}).tokens(None) == prompt_tokens({"prompt": "abc"})
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "héllo"}]}]}
    assert prompt_tokens(parts) == estimate  # a content part of text: its text
    ids = {"prompt": [5, 6, 7, 8]}  # token ids: one each
    assert prompt_tokens(ids) == 4 + REQUEST_OVERHEAD
    assert prompt_tokens({"prompt": [[5, 6], [7]]}) == 3 + REQUEST_OVERHEAD
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    # a tool as the template renders it: compact JSON, its punctuation one a character
    rendered = '{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}'
    assert prompt_tokens({"tools": [tool]}) == text_tokens(rendered) + REQUEST_OVERHEAD
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}
    assert prompt_tokens({"messages": [call]}) > MESSAGE_OVERHEAD + REQUEST_OVERHEAD


def test_r_t1_a_body_nested_as_deep_as_json_allows_is_estimated_not_a_crash() -> None:
    deep: object = "x"
    for _ in range(100_000):
        deep = [deep]
    assert prompt_tokens({"prompt": deep}) >= 1
    nested: object = {"k": "v"}
    for _ in range(100_000):
        nested = {"k": nested}
    assert prompt_tokens({"tools": nested}) > 100_000


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
        await request(_chat("7" * 400, max_tokens=10))  # 400 digits: the prompt is over 300
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
    expected = prompt_tokens(json.loads(body)) + 100
    assert seen_running == [expected, 300]  # each charge in the segment while it ran
