"""The table of server kinds (capacity_router/kinds.py) is the one place a kind lives (R-K5)."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest
from router_support import ScriptedServer, rows

from capacity_router import RouterServer, kinds
from capacity_router.poller import poll_url
from capacity_router.registry import SlotSource, Worker, parse_registry
from capacity_router.simworker import SimWorker

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", kinds.KINDS, ids=[k.name for k in kinds.KINDS])
def test_r_k5_every_kind_names_a_reader_that_exists(kind: kinds.ServerKind) -> None:
    assert inspect.iscoroutinefunction(kind.read)
    assert (kind.fixed == "refused") == (kind.fixed_means == "")


def test_r_k5_registry_sources_and_simulated_shapes_come_from_the_table() -> None:
    for source in kinds.SOURCES:
        fixed = None if kinds.BY_SOURCE[source].fixed == "refused" else 3
        slots = SlotSource(source=source, fixed=fixed)
        assert slots.server_kind is kinds.BY_SOURCE[source]
    for shape in kinds.SHAPES:
        SimWorker(shape=shape)  # accepted, not started
    from gateway_capacity.cmd_router import _SIM_SERVES, SIM_SHAPES

    assert SIM_SHAPES == kinds.SHAPES and set(_SIM_SERVES) == set(kinds.SHAPES)


def test_r_k5_an_unknown_source_is_refused_naming_the_known_ones() -> None:
    entry = {"id": "a", "urls": ["http://h:1"], "models": ["m"], "slots": {"source": "triton"}}
    body = msgspec.json.encode({"workers": [entry]})
    with pytest.raises(ValueError, match="unknown source 'triton'; one of props, llama-server"):
        parse_registry(body)


def test_r_k5_each_kind_has_its_row_in_the_router_docs() -> None:
    text = (ROOT / "docs/router.md").read_text()
    rows = set(re.findall(r"^\| `([a-z-]+)`", text, re.M))
    named = {k.source for k in kinds.KINDS if k.source is not None}
    assert named <= rows, f"docs/router.md lacks rows for {sorted(named - rows)}"


def test_r_k5_a_reader_that_fails_unforeseen_makes_one_worker_unreadable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken(*args: object) -> object:
        raise KeyError("not foreseen")

    from capacity_router import sources

    monkeypatch.setattr(sources, "read_tgi", broken)
    server = ScriptedServer()
    try:
        server.route("/health", 200, "{}")
        w = Worker(id="w", urls=(server.url,), models=("m",), slots=SlotSource(source="tgi"))

        async def go() -> object:
            async with httpx.AsyncClient(trust_env=False) as client:
                return await poll_url(client, w, server.url, 5.0)

        obs = asyncio.run(go())
    finally:
        server.stop()
    assert obs.state == "unreadable"
    assert "reader failed (KeyError)" in obs.reason


def test_r_k5_a_read_for_router_show_that_hangs_leaves_the_worker_read(
    router: Callable[..., RouterServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    from capacity_router import sources

    monkeypatch.setattr(sources, "OPTIONAL_READ_S", 0.2)  # its bound, shortened for the test
    server = ScriptedServer()
    try:
        server.route("/health", 200, '{"status":"ok"}')
        server.route("/props", 200, '{"total_slots": 3}')
        server.hangs.add("/slots")  # what it is doing: asked, never answered
        entry = {"id": "w", "urls": [server.url], "models": ["m"], "slots": {"source": "props"}}
        r = router([entry], poll_timeout=2.0)
        snap = r.observe()
        assert snap.complete and rows(snap) == {"m": 3}
        assert "/slots" in server.requested and r.workers()[0].activity == ""
    finally:
        server.stop()
