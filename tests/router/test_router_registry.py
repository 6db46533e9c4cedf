"""The worker registry file: what is refused, and how edits are followed (R-K5 "registered")."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from router_support import worker, write_registry

from capacity_router import RegistryError, RegistryWatcher, parse_registry


def body(*workers: dict[str, Any]) -> bytes:
    return json.dumps({"workers": list(workers)}).encode()


def test_registry_example_from_the_docs_parses() -> None:
    registry = parse_registry(
        body(
            worker(
                "mac-studio-1",
                ["http://100.101.102.103:8080", "http://mac-1.example:8080"],
                ["workhorse", "workhorse-long"],
            ),
            worker("linux-box", ["http://10.0.0.7:8000"], ["workhorse"], {"fixed": 4}, fenced=True),
        )
    )
    assert [w.id for w in registry.workers] == ["mac-studio-1", "linux-box"]
    assert registry.workers[1].slots.fixed == 4
    assert registry.workers[1].fenced is True
    assert registry.workers[0].fenced is False


@pytest.mark.parametrize(
    ("entries", "needle"),
    [
        ([worker("a", ["http://h:1"], ["m"]), worker("a", ["http://h:2"], ["m"])], "appears twice"),
        ([worker("a", ["http://H:80/"], ["m"]), worker("b", ["http://h"], ["m"])], "one id"),
        ([worker("a", ["http://h:1"], ["m"], fence=True)], "fence"),
        ([worker("a", ["http://h:1"], ["m"], {"source": "props", "fixed": 3})], 'drop "fixed"'),
        ([worker("a", ["http://h:1"], ["m"], {"source": "vllm"})], 'add "fixed": N'),
        ([worker("a", ["http://h:1"], ["m"], {"source": "triton"})], "invalid registry"),
        ([worker("a", ["http://h:1"], ["m"], keyFile="")], "invalid registry"),
        ([worker("a", ["http://h:1"], ["m"], {})], "slots must be"),
        ([worker("a", ["http://h:1"], ["m"], {"fixed": 3.0})], "Expected `int"),
        ([worker("a", ["http://h:1"], ["m"], {"fixed": True})], "Expected `int"),
        ([worker("a", ["http://h:1"], ["m"], {"fixed": 4097})], "<= 4096"),
        ([worker("a", ["http://h:1"], ["m"], {"source": "metrics"})], "source"),
        ([worker("a", ["ftp://h:1"], ["m"])], "scheme"),
        ([worker("a", ["http://user:pw@h:1"], ["m"])], "credentials"),
        ([worker("a", ["http://h:1?x=1"], ["m"])], "query"),
        ([worker("a", ["http://h:99999"], ["m"])], "url"),
        ([worker("a", [], ["m"])], "length"),
        ([worker("a", ["http://h:1"], [])], "length"),
        ([worker("a/b", ["http://h:1"], ["m"])], "id"),
        ([worker("a", ["http://h:1"], [f"m{i}" for i in range(129)])], "length"),
        (
            [worker(f"w{i}", [f"http://h{i}:1"], [f"m{i}a", f"m{i}b"]) for i in range(65)],
            "at most 128",
        ),
    ],
)
def test_r_k5_bad_registry_is_refused_with_a_reason(
    entries: list[dict[str, Any]], needle: str
) -> None:
    with pytest.raises(RegistryError) as info:
        parse_registry(body(*entries))
    assert needle in str(info.value)


def test_registry_unknown_top_level_field_is_refused() -> None:
    with pytest.raises(RegistryError):
        parse_registry(b'{"workers": [], "worker": []}')


def test_registry_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="cannot open registry"):
        RegistryWatcher(tmp_path / "absent.json")


def test_registry_watcher_follows_edits_and_keeps_last_good_on_a_broken_one(
    registry_path: Path,
) -> None:
    write_registry(registry_path, [worker("a", ["http://h:1"], ["m"])])
    watcher = RegistryWatcher(registry_path)
    assert watcher.refresh() is False

    write_registry(
        registry_path, [worker("a", ["http://h:1"], ["m"]), worker("b", ["http://h:2"], ["m"])]
    )
    assert watcher.refresh() is True
    assert [w.id for w in watcher.current.workers] == ["a", "b"]

    registry_path.write_text('{"workers": [')  # in place, truncated
    assert watcher.refresh() is False
    assert [w.id for w in watcher.current.workers] == ["a", "b"]
    assert watcher.last_error is not None and "invalid JSON" in watcher.last_error

    os.unlink(registry_path)
    assert watcher.refresh() is False
    assert [w.id for w in watcher.current.workers] == ["a", "b"]

    write_registry(registry_path, [worker("c", ["http://h:3"], ["m"])])
    assert watcher.refresh() is True
    assert [w.id for w in watcher.current.workers] == ["c"]
    assert watcher.last_error is None


def test_r_k5_shared_sockets_warns_only_for_two_ids_on_one_address_and_path() -> None:
    from capacity_router.sockets import shared_sockets

    def ids(*entries: tuple[str, list[str]]) -> list[str]:
        doc = {
            "workers": [
                {"id": i, "urls": urls, "models": ["m"], "slots": {"fixed": 1}}
                for i, urls in entries
            ]
        }
        return shared_sockets(parse_registry(json.dumps(doc).encode()).workers)

    assert len(ids(("a", ["http://127.0.0.1:8080"]), ("b", ["http://localhost:8080"]))) == 1
    assert ids(("a", ["http://127.0.0.1:8080", "http://localhost:8080"])) == []  # one id
    assert ids(("a", ["http://127.0.0.1:8080"]), ("b", ["http://127.0.0.1:8081"])) == []
    swap = "http://127.0.0.1:8080/upstream/"
    assert ids(("a", [swap + "one"]), ("b", [swap + "two"])) == []  # two paths
    assert ids(("a", ["http://127.0.0.1:1"]), ("b", ["http://no-such-host.invalid:1"])) == []


def test_r_p6_the_registry_bound_is_the_longest_snapshot_to_the_byte() -> None:
    """Ids that reach 65,536 bytes exactly at their longest snapshot pass, one byte more
    is refused: UTF-8, JSON escaping, a 4-digit count, both token fields at their bound
    (R-K7) and the longest float counted."""
    from capacity_contract import (
        MAX_SNAPSHOT_BYTES,
        MAX_TOKENS,
        CapacitySnapshot,
        ModelCapacity,
        encode_snapshot,
    )

    ids = ['é"\n' * 66 + f"{i:03d}" for i in range(128)]  # 2 + 2 + 2 bytes a triple
    longest = CapacitySnapshot(
        object="inference_capacity",
        version=1,
        complete=False,
        observed_at=-2.2250738585072014e-308,
        models=[
            ModelCapacity(
                id=m,
                max_concurrent_requests=4096,
                max_request_tokens=MAX_TOKENS,
                max_running_tokens=MAX_TOKENS,
            )
            for m in ids
        ],
    )
    size = len(encode_snapshot(longest))
    pad = MAX_SNAPSHOT_BYTES - size  # spread over the ids, a byte or a few each
    assert 0 < pad < 128 * 16  # each id stays within 256 characters
    fitting = [m + "x" * (pad // 128 + (i < pad % 128)) for i, m in enumerate(ids)]

    def registry(models: list[str]) -> bytes:
        w = {"id": "w", "urls": ["http://127.0.0.1:9"], "models": models, "slots": {"fixed": 1}}
        return json.dumps({"workers": [w]}).encode()

    parse_registry(registry(fitting))
    over = [fitting[0] + "x", *fitting[1:]]
    with pytest.raises(RegistryError, match=f"could reach {MAX_SNAPSHOT_BYTES + 1} bytes"):
        parse_registry(registry(over))
