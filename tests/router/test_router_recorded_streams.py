"""Streams recorded from real servers, relayed by the router to the openai SDK (R-K5).

A fixture under tests/router/fixtures with ``streams`` carries the bytes a real server
streamed (scripts/record-real-servers.py); a loopback server replays them with the
fixture's ``answers``, and the router relays them. transformers serve ends its streams
without ``data: [DONE]``: the relay must pass them on as they are and the SDK must end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from router_support import KEY, LoopbackHTTP, QuietHandler, Router, worker

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p for p in FIXTURES.glob("*.json") if "streams" in json.loads(p.read_text()))


class Replay(LoopbackHTTP):
    """GETs from the fixture's ``answers``, POSTs from its ``streams``."""

    def __init__(self, doc: dict[str, Any]) -> None:
        answers: dict[str, Any] = doc["answers"]
        streams: dict[str, Any] = doc["streams"]

        class Handler(QuietHandler):
            def _send(self, status: int, kind: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                answer = answers.get(self.path)
                if answer is None:
                    self._send(404, "text/plain", b"not found")
                elif "json" in answer:
                    self._send(
                        answer["status"], "application/json", json.dumps(answer["json"]).encode()
                    )
                else:
                    self._send(answer["status"], "text/plain", answer["text"].encode())

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                answer = streams.get(self.path)
                if answer is None:
                    self._send(404, "text/plain", b"not found")
                    return
                self._send(answer["status"], answer["content_type"], answer["text"].encode())

        super().__init__(Handler)


@pytest.fixture
def replay() -> Iterator[Callable[[dict[str, Any]], Replay]]:
    started: list[Replay] = []

    def start(doc: dict[str, Any]) -> Replay:
        started.append(Replay(doc))
        return started[-1]

    yield start
    for r in started:
        r.stop()


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_r_k5_a_recorded_stream_relays_byte_for_byte_and_the_sdk_ends(
    path: Path, replay: Callable[[dict[str, Any]], Replay], router: Router
) -> None:
    doc: dict[str, Any] = json.loads(path.read_text())
    server = replay(doc)
    reg = doc["registry"]
    r = router([worker("w", [server.url], reg["models"], reg["slots"])], poll_timeout=5.0)
    assert r.observe().complete is True
    recorded = doc["streams"]["/v1/chat/completions"]["text"].encode()
    body = {"model": reg["models"][0], "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream(
        "POST",
        f"{r.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={**body, "stream": True},
        trust_env=False,
    ) as raw:
        assert b"".join(raw.iter_raw()) == recorded
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key=KEY, max_retries=0, timeout=30)
    chunks = list(client.chat.completions.create(**body, stream=True))  # ends, [DONE] or not
    sent = [line for line in recorded.splitlines() if line.startswith(b"data: {")]
    assert len(chunks) == len(sent)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
