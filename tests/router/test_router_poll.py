"""What one poll of one worker concludes, against real HTTP servers on loopback (R-K5)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import msgspec
import pytest
from gwtest import free_port
from router_support import ScriptedServer

from capacity_router import Observation, Worker
from capacity_router.poller import new_client, poll_url, poll_worker
from capacity_router.registry import SlotSource

PROPS = SlotSource(source="props")


def poll(slots: SlotSource, url: str, timeout: float = 2.0) -> Observation:
    async def go() -> Observation:
        async with new_client(timeout) as client:
            worker = Worker(id="w", urls=(url,), models=("m",), slots=slots)
            return await poll_url(client, worker, url, timeout)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("status", "body", "state"),
    [
        (200, {"total_slots": 7, "model_path": "x", "chat_template": "{{ x }}"}, ("ok", 7)),
        (200, {"total_slots": 0}, ("ok", 0)),
        (200, {"total_slots": "7"}, ("unreadable", None)),
        (200, {"total_slots": True}, ("unreadable", None)),
        (200, {"total_slots": 7.5}, ("unreadable", None)),
        (200, {"total_slots": -1}, ("unreadable", None)),
        (200, {"total_slots": 4097}, ("unreadable", None)),
        (200, {"slots": 7}, ("unreadable", None)),
        (200, [7], ("unreadable", None)),
        (500, {"total_slots": 7}, ("unreadable", None)),
        (404, {"total_slots": 7}, ("unreadable", None)),
    ],
)
def test_r_k5_props_answer_is_read_or_marked_unreadable(
    scripted: Callable[[], ScriptedServer], status: int, body: object, state: tuple[str, int | None]
) -> None:
    server = scripted()
    server.route("/health", 200, '{"status":"ok"}')
    server.route("/props", status, json.dumps(body))
    obs = poll(PROPS, server.url)
    assert (obs.state, obs.slots) == state


def test_r_k5_props_garbage_body_is_unreadable(scripted: Callable[[], ScriptedServer]) -> None:
    server = scripted()
    server.route("/health", 200)
    server.route("/props", 200, b"\x00\xffnot json")
    assert poll(PROPS, server.url).state == "unreadable"


def test_r_k5_props_redirect_is_not_followed(scripted: Callable[[], ScriptedServer]) -> None:
    server = scripted()
    server.route("/health", 200)
    server.route("/props", 302, Location=f"{server.url}/elsewhere")
    server.route("/elsewhere", 200, '{"total_slots": 50}')
    obs = poll(PROPS, server.url)
    assert obs.state == "unreadable"
    assert "302" in obs.reason


def test_r_k5_props_body_over_the_bound_is_unreadable(
    scripted: Callable[[], ScriptedServer],
) -> None:
    server = scripted()
    server.route("/health", 200)
    server.route("/props", 200, b'{"total_slots": 3, "pad": "' + b"x" * (1 << 21) + b'"}')
    obs = poll(PROPS, server.url)
    assert obs.state == "unreadable"
    assert "over" in obs.reason


@pytest.mark.parametrize("status", [503, 500, 404, 302])
def test_r_k5_props_worker_needs_health_200(
    scripted: Callable[[], ScriptedServer], status: int
) -> None:
    server = scripted()
    server.route("/health", status)
    server.route("/props", 200, '{"total_slots": 7}')
    assert poll(PROPS, server.url).state == "unhealthy"


@pytest.mark.parametrize(
    ("status", "state"),
    [(200, "ok"), (404, "ok"), (501, "ok"), (503, "unhealthy"), (502, "unhealthy")],
)
def test_r_k5_fixed_worker_counts_while_alive_without_a_health_endpoint(
    scripted: Callable[[], ScriptedServer], status: int, state: str
) -> None:
    server = scripted()
    server.route("/health", status)
    obs = poll(SlotSource(fixed=6), server.url)
    assert obs.state == state
    assert obs.slots == (6 if state == "ok" else None)


def test_r_k5_nothing_listening_is_unreachable() -> None:
    obs = poll(PROPS, f"http://127.0.0.1:{free_port()}")
    assert obs.state == "unreachable"


def test_r_k5_url_path_prefix_is_kept(scripted: Callable[[], ScriptedServer]) -> None:
    server = scripted()  # e.g. llama-swap's /upstream/{model} passthrough
    server.route("/upstream/wh/health", 200)
    server.route("/upstream/wh/props", 200, '{"total_slots": 5}')
    assert poll(PROPS, f"{server.url}/upstream/wh/").slots == 5


def test_r_k5_one_worker_through_several_urls_best_answer_wins(
    scripted: Callable[[], ScriptedServer],
) -> None:
    server = scripted()
    server.route("/health", 200)
    server.route("/props", 200, '{"total_slots": 9}')
    worker = msgspec.convert(
        {
            "id": "a",
            "urls": [f"http://127.0.0.1:{free_port()}", server.url],
            "models": ["m"],
            "slots": {"source": "props"},
        },
        Worker,
    )

    async def go() -> Observation:
        async with new_client(2.0) as client:
            return await poll_worker(client, worker, 2.0)

    assert asyncio.run(go()) == Observation("ok", 9, "props")
