"""What the recorders (scripts/record-*.py) share: asking a real server, writing a fixture.

A fixture is one JSON document per server shape, in the format
tests/router/test_router_fixtures.py replays (``kind: recorded``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx


def answers(url: str, paths: list[str], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Each GET's status and body (its JSON, or its text where it is not JSON)."""
    out: dict[str, Any] = {}
    for path in paths:
        answer = httpx.get(url + path, headers=headers or {}, timeout=30.0)
        try:
            out[path] = {"status": answer.status_code, "json": answer.json()}
        except ValueError:
            out[path] = {"status": answer.status_code, "text": answer.text}
        print(f"  GET {path} -> {answer.status_code} ({len(answer.content)} bytes)")
    return out


def write_fixture(
    out: Path, name: str, server: str, version: str, follows: list[str], **doc: Any
) -> None:
    record = {"server": server, "version": version, "kind": "recorded", "follows": follows}
    record.update(doc)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {name}.json")
