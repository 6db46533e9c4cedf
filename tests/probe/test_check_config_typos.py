"""check-config on the keys a new operator mistypes (R-C1: unknown keys are ignored and the
sidecar runs; the product's own keys are checked), and on share mode."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway_capacity.cli import main

WriteConfig = Callable[..., Path]


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str = ""


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Ran]:
    """The CLI in this process (what the installed command runs; no interpreter start)."""

    def run(*args: str) -> Ran:
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Ran(code, captured.out, captured.err)

    return run


def test_a_mistyped_key_of_ours_is_named_with_the_one_meant_and_strict_fails(
    write_config: WriteConfig, run_cli: Callable[..., Ran]
) -> None:
    cfg = write_config(
        {
            "maxConcurent": 8,
            "providers": [{"id": "llama-a", "capacityDiscovry": True, "base_url": "x"}],
            "capacityShare": {"redis": "redis://127.0.0.1:6399", "gateway": "a", "leese": 5},
        }
    )
    loose = run_cli("check-config", "--config", str(cfg))
    assert loose.returncode == 0, loose.stderr
    lines = loose.stdout.splitlines()
    for expected in (
        "unknown key 'maxConcurent' in the top level; did you mean maxConcurrent? (ignored)",
        "unknown key 'leese' in capacityShare; did you mean lease? (ignored)",
        "unknown key 'capacityDiscovry' in providers[0] (llama-a); did you mean "
        "capacityDiscovery? (ignored)",
        "unknown key 'base_url' in providers[0] (llama-a); did you mean baseUrl? (ignored)",
    ):
        assert expected in lines, loose.stdout
    assert run_cli("check-config", "--config", str(cfg), "--strict").returncode == 1
    doc = json.loads(run_cli("check-config", "--config", str(cfg), "--json").stdout)
    assert {"where": "capacityShare", "key": "leese", "suggestion": "lease"} in doc["unknown_keys"]


def test_every_unknown_key_in_capacity_share_is_named_even_far_from_a_known_one(
    write_config: WriteConfig, run_cli: Callable[..., Ran]
) -> None:
    cfg = write_config(
        {"capacityShare": {"redis": "redis://127.0.0.1:6399", "gateway": "a", "zzz": 1}}
    )
    out = run_cli("check-config", "--config", str(cfg), "--strict")
    assert out.returncode == 1
    assert "unknown key 'zzz' in capacityShare (ignored)" in out.stdout.splitlines()


def test_r_c1_the_gateways_own_keys_pass_strict(
    write_config: WriteConfig, run_cli: Callable[..., Ran]
) -> None:
    cfg = write_config(
        {
            "port": 8080,
            "logLevel": "info",
            "routes": [{"path": "/v1"}],
            "providers": [
                {
                    "id": "static",
                    "type": "chat-completions-api",
                    "maxConcurrent": 3,
                    "apiKeyEnv": "OPENAI_API_KEY",
                    "headers": {"x": "y"},
                    "timeout": 30,
                    "model": "gpt",
                    "unknownField": {"kept": True},
                }
            ],
        }
    )
    out = run_cli("check-config", "--config", str(cfg), "--strict")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "unknown key" not in out.stdout


def test_check_config_says_share_mode_is_off(
    write_config: WriteConfig, run_cli: Callable[..., Ran]
) -> None:
    out = run_cli("check-config", "--config", str(write_config({"providers": []})))
    assert out.stdout.splitlines()[-1].startswith("share mode: off (no capacityShare); redis-py ")


def test_check_config_with_share_mode_off_does_not_ask_for_redis_py(
    write_config: WriteConfig, run_cli: Callable[..., Ran], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # a host without the share extra
    out = run_cli("check-config", "--config", str(write_config({"providers": []})), "--strict")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "share mode: off (no capacityShare)"
    assert "pip install" not in out.stdout


def test_check_config_shows_share_mode_and_whether_it_can_start(
    tmp_path: Path, write_config: WriteConfig, run_cli: Callable[..., Ran]
) -> None:
    secret = "redis-pass-" + "7" * 12
    cred = tmp_path / "redis.key"
    cred.write_text(secret + "\n")
    cred.chmod(0o600)
    share = {"redis": "redis://127.0.0.1:6399/0", "gateway": "gw-a", "credentialFile": str(cred)}
    cfg = write_config({"capacityShare": share})
    out = run_cli("check-config", "--config", str(cfg), "--strict")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout.splitlines()
    start = text.index("share mode: ON, gateway 'gw-a', Redis redis://127.0.0.1:6399/0")
    assert text[start + 1].startswith("  redis-py: importable (")
    assert text[start + 2] == "  credential: readable, well-formed (not shown)"
    assert text[start + 3] == (
        "  a loopback Redis/sentinel must be listened on by root, this user or a redis/valkey user"
    )
    assert text[start + 4].startswith("  Redis out of reach for longer than a lease: ")
    assert secret not in out.stdout

    cred.chmod(0o644)
    out = run_cli("check-config", "--config", str(cfg), "--strict")
    assert out.returncode == 1
    assert "  problem: capacityShare.credentialFile: " in out.stdout
    assert f"chmod 600 {cred}" in out.stdout and secret not in out.stdout
    doc = json.loads(run_cli("check-config", "--config", str(cfg), "--json").stdout)
    assert doc["share"]["on"] is True and doc["share"]["credential"] != "ok"


def test_check_config_shows_the_sentinel_set_and_the_listener_owner(
    write_config: WriteConfig, run_cli: Callable[..., Ran]
) -> None:
    sentinel = {"master": "gwcap", "addresses": ["127.0.0.1:26379", "127.0.0.1:26380"]}
    share = {"sentinel": sentinel, "gateway": "gw-a", "listenerOwner": "redis"}
    out = run_cli("check-config", "--config", str(write_config({"capacityShare": share})))
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout.splitlines()
    start = text.index(
        "share mode: ON, gateway 'gw-a', the master 'gwcap' of the Sentinel set "
        "127.0.0.1:26379, 127.0.0.1:26380 (a failover rebuilds each table)"
    )
    assert "  a loopback Redis/sentinel must be listened on by listenerOwner 'redis'" in text
    assert text.index("  credential: none (capacityShare.credentialFile not set)") > start
    doc = json.loads(
        run_cli(
            "check-config", "--config", str(write_config({"capacityShare": share})), "--json"
        ).stdout
    )
    assert doc["share"]["sentinel"] == sentinel and doc["share"]["redis"] is None


@pytest.mark.parametrize(
    ("outage", "said", "rule"),
    [
        ({}, "every gateway holds 0 until Redis answers (no gateways declared: declare", "hold"),
        (
            {"gateways": 3},
            "each gateway keeps floor(C x 0.5 / 3) of the capacity C it discovers, without "
            "Redis; the table shares the rest and refuses a gateway beyond 3 live at once",
            "keep",
        ),
        (
            {"gateways": 2, "keepPart": 0.25, "outage": "keep"},
            "each gateway keeps floor(C x 0.25 / 2) of the capacity C",
            "keep",
        ),
        (
            {"gateways": 2, "outage": "hold"},
            "every gateway holds 0 until Redis answers (outage: hold); the table refuses a "
            "gateway beyond 2 live at once",
            "hold",
        ),
    ],
)
def test_check_config_shows_the_outage_rule(
    write_config: WriteConfig,
    run_cli: Callable[..., Ran],
    outage: dict[str, Any],
    said: str,
    rule: str,
) -> None:
    """Without ``gateways`` declared (every config written before the rule) a gateway
    holds 0 through an outage, as before; declared, it keeps its part unless told to
    hold, and check-config says which."""
    share = {"redis": "redis://127.0.0.1:6399/0", "gateway": "gw-a", **outage}
    cfg = write_config({"capacityShare": share})
    out = run_cli("check-config", "--config", str(cfg))
    assert out.returncode == 0, out.stdout + out.stderr
    line = "  Redis out of reach for longer than a lease: " + said
    assert any(t.startswith(line) for t in out.stdout.splitlines()), out.stdout
    doc = json.loads(run_cli("check-config", "--config", str(cfg), "--json").stdout)
    assert doc["share"]["outage"]["rule"] == rule
    assert doc["share"]["outage"]["gateways"] == outage.get("gateways")


def test_check_config_says_when_redis_py_is_missing(
    write_config: WriteConfig, run_cli: Callable[..., Ran], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a host where the share extra was not installed (``import redis`` fails): the
    share config cannot be checked, so the file is refused as unusable (exit 2), in one
    line that says what to install."""
    monkeypatch.setitem(sys.modules, "redis", None)
    cfg = write_config({"capacityShare": {"redis": "redis://127.0.0.1:6399", "gateway": "a"}})
    out = run_cli("check-config", "--config", str(cfg), "--strict")
    err = out.stderr
    assert out.returncode == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "pip install 'gateway-capacity[share]'" in err


@pytest.mark.parametrize("value", [True, "yes"])
def test_a_known_key_is_never_reported_as_unknown(
    write_config: WriteConfig, run_cli: Callable[..., Ran], value: object
) -> None:
    cfg = write_config({"providers": [{"id": "p", "capacityDiscovery": value}]})
    assert "unknown key" not in run_cli("check-config", "--config", str(cfg)).stdout


def test_r_c1_the_loaded_config_carries_the_typos_for_the_sidecar_to_log() -> None:
    from sidecar.config import parse_config

    config = parse_config(b'{"providers": [{"id": "a", "credentialfile": "/k"}], "port": 1}')
    assert [str(u) for u in config.unknown_keys] == [
        "unknown key 'credentialfile' in providers[0] (a); did you mean credentialFile? (ignored)"
    ]
    assert config.provider("a") is not None  # the entry is used as before


def test_a_typo_that_leaves_capacity_share_incomplete_is_named_in_the_refusal(
    write_config: WriteConfig, run_cli: Callable[..., Ran], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config({"capacityShare": {"redis": "redis://127.0.0.1:6399", "gatway": "a"}})
    try:
        main(["check-config", "--config", str(cfg)])
    except SystemExit as exc:
        assert exc.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"gateway-capacity: config {cfg}: capacityShare: Object missing required field "
        "`gateway`; unknown key 'gatway' in capacityShare; did you mean gateway? (ignored)"
    )
