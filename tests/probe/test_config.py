"""The gateway's config file (R-C1..R-C3, R-P1 static part, REQUIREMENTS.md section 5 fallback)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.config import (
    ConfigError,
    GatewayConfig,
    load_config,
    parse_base_url,
    parse_config,
)
from sidecar.limits import fallback_for

EXAMPLE_CONFIG = {
    "maxConcurrent": 8,
    "providers": [
        {
            "id": "local-inference",
            "type": "chat-completions-api",
            "baseUrl": "http://inference.example/v1",
            "tailnet": True,
            "credentialFile": "/private/local-inference.key",
            "capacityDiscovery": True,
            "maxConcurrent": 12,
            "models": {"local-workhorse": "workhorse"},
        }
    ],
}


def good(pid: str, **fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": pid,
        "baseUrl": "http://127.0.0.1:8080/v1",
        "credentialFile": "/run/keys/router.key",
        "capacityDiscovery": True,
        "models": {"alias": "workhorse"},
    }
    entry.update(fields)
    return entry


def parse(doc: Any) -> GatewayConfig:
    return parse_config(json.dumps(doc).encode(), "test.json")


def test_r_c2_spec_example_loads_with_models_mapping_to_upstream_ids(tmp_path: Path) -> None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(EXAMPLE_CONFIG))
    cfg = load_config(path)
    (p,) = cfg.providers
    assert cfg.max_concurrent == 8
    assert p.id == "local-inference" and p.type == "chat-completions-api"
    assert p.base_url == "http://inference.example/v1"
    assert p.tailnet is True and p.capacity_discovery is True
    assert p.credential_file == "/private/local-inference.key"
    assert p.max_concurrent == 12
    assert p.models == {"local-workhorse": "workhorse"}
    assert p.upstream_models == frozenset({"workhorse"})
    status = cfg.statuses["local-inference"]
    assert (status.discovery_requested, status.discovery_active) == (True, True)
    assert status.reason == "opt_in_ok:tailnet"


def test_r_c1_unknown_fields_anywhere_are_accepted(tmp_path: Path) -> None:
    doc = json.loads(json.dumps(EXAMPLE_CONFIG))
    doc["routes"] = [{"anything": True}]
    doc["providers"][0]["headers"] = {"X-Thing": "1"}
    doc["providers"][0]["retry"] = {"max": 3, "nested": [1, {"deep": None}]}
    cfg = parse(doc)
    assert cfg.statuses["local-inference"].discovery_active


def test_r_c1_load_never_modifies_the_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(EXAMPLE_CONFIG, indent=4) + "\n")
    path.chmod(0o444)
    before = (
        path.stat(),
        hashlib.sha256(path.read_bytes()).hexdigest(),
        sorted(os.listdir(tmp_path)),
    )
    load_config(path)
    after = (
        path.stat(),
        hashlib.sha256(path.read_bytes()).hexdigest(),
        sorted(os.listdir(tmp_path)),
    )
    assert before[0].st_mtime_ns == after[0].st_mtime_ns
    assert before[0].st_ino == after[0].st_ino
    assert before[0].st_mode == after[0].st_mode
    assert before[1:] == after[1:]


def _load_error(tmp: Path, content: bytes) -> str:
    """The ConfigError that loading ``content`` as a config file raises, as said."""
    path = tmp / "gateway.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[]", "top level must be a JSON object"),
        (b'{"providers": {}}', "providers must be a JSON array"),
        (b'{"maxConcurrent": "8"}', "top-level maxConcurrent"),
        (b'{"maxConcurrent": true}', "top-level maxConcurrent"),
        (b'{"maxConcurrent": -1}', "top-level maxConcurrent"),
        (b'{"maxConcurrent": 2.5}', "top-level maxConcurrent"),
    ],
)
def test_r_c3_unusable_file_is_one_clear_config_error(
    tmp_path: Path, content: bytes, match: str
) -> None:
    said = _load_error(tmp_path, content)
    assert re.search(match, said), said
    assert "\n" not in said
    assert str(tmp_path / "gateway.json") in said


def test_r_c3_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config .*No such file"):
        load_config(tmp_path / "absent.json")


def test_r_c3_no_providers_is_an_empty_config() -> None:
    cfg = parse({"maxConcurrent": 3})
    assert cfg.providers == () and cfg.skipped == () and cfg.max_concurrent == 3


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"tailnet": "yes"}, "tailnet"),
        ({"capacityDiscovery": 1}, "capacityDiscovery"),
        ({"maxConcurrent": True}, "maxConcurrent"),
        ({"maxConcurrent": 2.5}, "maxConcurrent"),
        ({"maxConcurrent": "12"}, "maxConcurrent"),
        ({"maxConcurrent": -1}, "maxConcurrent"),
        ({"models": ["workhorse"]}, "models"),
        ({"models": {"alias": 7}}, "models"),
        ({"models": {"alias": ""}}, "models"),
        ({"baseUrl": 8080}, "baseUrl"),
        ({"credentialFile": ["/k"]}, "credentialFile"),
    ],
)
def test_r_c3_bad_field_disables_only_that_provider(bad: dict[str, Any], field: str) -> None:
    cfg = parse({"providers": [good("before"), good("bad", **bad), good("after")]})
    assert [p.id for p in cfg.providers] == ["before", "bad", "after"]
    assert cfg.statuses["before"].discovery_active
    assert cfg.statuses["after"].discovery_active
    status = cfg.statuses["bad"]
    assert not status.discovery_active
    assert status.reason.startswith(f"config_invalid:{field}")


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"capacityDiscovery": False}, "not_requested"),
        ({"capacityDiscovery": None}, "config_invalid:capacityDiscovery"),
        ({"baseUrl": None}, "config_invalid:baseUrl is required"),
        ({"credentialFile": None}, "config_invalid:credentialFile is required"),
        ({"credentialFile": "keys/router.key"}, "config_invalid:credentialFile"),
        ({"models": {}}, "config_invalid:models is empty"),
        ({"baseUrl": "ftp://127.0.0.1/v1"}, "config_invalid:baseUrl must start with http"),
        (
            {"baseUrl": "http://user:pw@127.0.0.1/v1"},
            "config_invalid:baseUrl must not contain user",
        ),
        ({"baseUrl": "http://127.0.0.1/v1?x=1"}, "config_invalid:baseUrl must not have a query"),
        ({"baseUrl": "http://127.0.0.1:99999/v1"}, "config_invalid:baseUrl is not a valid URL"),
        ({"baseUrl": "http:///v1"}, "config_invalid:baseUrl has no host"),
        ({"baseUrl": "http://r\u00f6uter/v1", "tailnet": True}, "config_invalid:baseUrl host"),
        ({"baseUrl": "http://api.example.com/v1"}, "opt_in_refused:"),
        ({"baseUrl": "http://100.101.102.103/v1"}, "opt_in_refused:"),
        ({"baseUrl": "http://10.1.2.3/v1", "tailnet": True}, "opt_in_refused:"),
        ({"baseUrl": "http://localhost:8080/v1"}, "opt_in_ok:loopback"),
        ({"baseUrl": "http://[::1]:8080/v1"}, "opt_in_ok:loopback"),
        ({"baseUrl": "https://router.tail1.ts.net/v1", "tailnet": True}, "opt_in_ok:tailnet"),
        ({"credentialFile": "systemd-credential:router"}, "opt_in_ok:loopback"),
    ],
)
def test_r_p1_static_discovery_status(fields: dict[str, Any], reason: str) -> None:
    cfg = parse({"providers": [good("p", **fields)]})
    assert cfg.statuses["p"].reason.startswith(reason), cfg.statuses["p"]
    assert cfg.statuses["p"].discovery_active is reason.startswith("opt_in_ok")


@pytest.mark.parametrize(
    ("pid", "kept"),
    [
        ("a" * 64, True),
        ("\u00e9" * 32, True),  # 64 bytes of UTF-8
        ("a" * 65, False),
        ("\u00e9" * 33, False),  # 33 characters, 66 bytes
        ("", False),
        (7, False),
        (None, False),
        ("bad\nid", False),
    ],
)
def test_r_c3_provider_id_must_fit_the_segment(pid: Any, kept: bool) -> None:
    cfg = parse({"providers": [good("other"), {**good("x"), "id": pid}]})
    assert cfg.statuses["other"].discovery_active
    assert (pid in cfg.statuses) is kept
    assert (len(cfg.skipped) == 0) is kept
    if not kept:
        assert cfg.skipped[0].startswith("providers[1]: id")


def test_r_c3_entry_without_id_and_non_object_entries_are_skipped_with_reasons() -> None:
    cfg = parse({"providers": [5, {"baseUrl": "http://127.0.0.1"}, good("ok")]})
    assert [p.id for p in cfg.providers] == ["ok"]
    assert cfg.skipped == (
        "providers[0]: not a JSON object",
        "providers[1]: id is missing or not a string (entry skipped)",
    )


def test_r_c3_duplicate_id_keeps_the_first_entry() -> None:
    cfg = parse({"providers": [good("p", maxConcurrent=3), good("p", maxConcurrent=9)]})
    (p,) = cfg.providers
    assert p.max_concurrent == 3
    assert cfg.skipped == ("providers[1]: duplicate id 'p' (the first entry is used)",)


@pytest.mark.parametrize(
    ("gateway", "provider", "expected"),
    [
        (8, 12, (12, "provider")),
        (8, 0, (0, "provider")),
        (8, None, (8, "gateway")),
        (None, None, (4, "default")),
        (None, 2, (2, "provider")),
    ],
)
def test_r_l1_fallback_limit(gateway: int | None, provider: int | None, expected: Any) -> None:
    doc: dict[str, Any] = {"providers": [good("p", maxConcurrent=provider)]}
    if gateway is not None:
        doc["maxConcurrent"] = gateway
    cfg = parse(doc)
    assert fallback_for(cfg.providers[0].max_concurrent, cfg.max_concurrent) == expected


def test_r_c3_invalid_entry_keeps_its_valid_max_concurrent_for_static_admission() -> None:
    cfg = parse({"maxConcurrent": 8, "providers": [good("p", maxConcurrent=3, tailnet="yes")]})
    assert fallback_for(cfg.providers[0].max_concurrent, cfg.max_concurrent) == (3, "provider")
    assert cfg.statuses["p"].discovery_requested is True
    assert cfg.statuses["p"].discovery_active is False


def test_r_c3_invalid_max_concurrent_falls_back_to_gateway_and_says_why() -> None:
    cfg = parse({"maxConcurrent": 8, "providers": [good("p", maxConcurrent="12")]})
    assert fallback_for(cfg.providers[0].max_concurrent, cfg.max_concurrent) == (8, "gateway")
    assert cfg.statuses["p"].reason.startswith("config_invalid:maxConcurrent")


@pytest.mark.parametrize(
    ("base_url", "url", "host_header", "sni"),
    [
        ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/v1/capacity", "127.0.0.1:8080", None),
        ("http://127.0.0.1:8080/v1/", "http://127.0.0.1:8080/v1/capacity", "127.0.0.1:8080", None),
        ("http://localhost", "http://127.0.0.1:80/capacity", "localhost", None),
        (
            "https://Router.ts.net/api/v1",
            "https://127.0.0.1:443/api/v1/capacity",
            "Router.ts.net",
            "router.ts.net",
        ),
        ("https://[::1]:8443/v1", "https://[::1]:8443/v1/capacity", "[::1]:8443", "::1"),
    ],
)
def test_r_p2_capacity_url_is_base_url_slash_capacity(
    base_url: str, url: str, host_header: str, sni: str | None
) -> None:
    endpoint = parse_base_url(base_url)
    pinned = "::1" if "[::1]" in base_url else "127.0.0.1"
    assert endpoint.url_for(pinned) == url
    assert endpoint.host_header == host_header
    if sni is not None:
        assert endpoint.host == sni


def test_handler_side_can_import_config_without_httpx() -> None:
    code = "import sys, sidecar.config; sys.exit(1 if 'httpx' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize(
    ("content", "where"),
    [
        (b'{\n  "maxConcurrent": 4,\n  "providers": [,]\n}', "line 3, column 17"),
        ('{\n  "ü": x}'.encode(), "line 2, column 8"),  # characters, not bytes
        (b'{\n  "providers": [\n', "JSON ends early (a brace, bracket or string is not"),
        (b'{\n  "providers": [\n', "line 2, column 17"),
        (b"\n\n", "the file is empty"),
    ],
)
def test_r_c3_a_json_error_gives_the_line_and_column_an_editor_shows(
    tmp_path: Path, content: bytes, where: str
) -> None:
    said = _load_error(tmp_path, content)
    assert where in said, said
    assert "byte" not in said
