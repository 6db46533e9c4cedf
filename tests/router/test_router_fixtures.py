"""The router against answers of real servers, replayed from tests/router/fixtures (R-K5).

Each fixture names the server version and the source function its answers follow
(fixtures/README.md); a loopback server replays them byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from router_support import Router, ScriptedServer, rows, worker

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(FIXTURES.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_each_fixture_names_its_server_version_and_source(path: Path) -> None:
    doc = load(path)
    assert doc["server"] and doc["version"] and doc["kind"]
    assert doc["follows"] and all(isinstance(f, str) and f for f in doc["follows"])


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_r_k5_router_reads_the_replayed_answers_of_each_server(
    path: Path, scripted: Callable[[], ScriptedServer], router: Router
) -> None:
    doc = load(path)
    server = scripted()
    for route, answer in doc["answers"].items():
        body = json.dumps(answer["json"]) if "json" in answer else answer["text"]
        kind = "application/json" if "json" in answer else "text/plain"
        server.route(route, answer["status"], body, **{"Content-Type": kind})
    reg = doc["registry"]
    # several reads in one poll: an honest deadline for a loaded machine
    r = router([worker("w", [server.url], reg["models"], reg["slots"])], poll_timeout=5.0)
    snap = r.observe()
    expect = doc["expect"]
    assert rows(snap) == expect["rows"]
    assert snap.complete is expect["complete"]
    status = r.workers()[0]
    assert list(status.unserved) == expect["unserved"]
    assert list(status.unlisted) == expect.get("unlisted", [])
    if "activity" in expect:
        assert status.activity == expect["activity"]
    # R-K7: each row's token fields as the server's own source states them, none where
    # it does not (a fixture without "tokens" states none)
    assert {
        row.id: [row.request_tokens, row.running_tokens]
        for row in snap.models
        if row.request_tokens is not None or row.running_tokens is not None
    } == expect.get("tokens", {})
    for path in expect.get("never", []):  # e.g. a path that would load or hold a model
        assert path not in server.requested
