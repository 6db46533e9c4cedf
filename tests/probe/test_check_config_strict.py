"""check-config as an operator runs it: --strict, every problem at once, the segment it names."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from gwtest import run_cli

from shm_layout.names import segment_name_for_config

WriteConfig = Callable[..., Path]


def _on_loopback(credential_file: Path) -> dict[str, object]:
    """A provider opting in to discovery on loopback, with this key file."""
    return {
        "id": "loop",
        "capacityDiscovery": True,
        "baseUrl": "http://127.0.0.1:9/v1",
        "credentialFile": str(credential_file),
        "models": {"a": "workhorse"},
    }


def test_strict_exits_1_and_lists_every_problem_of_a_provider(write_config: WriteConfig) -> None:
    cfg = write_config(
        {
            "providers": [
                {
                    "id": "broken",
                    "capacityDiscovery": True,
                    "baseUrl": "http://inference.example/v1",  # not loopback, no tailnet
                    "credentialFile": "relative.key",  # not absolute
                    "maxConcurrent": -3,  # wrong value
                },
                {"id": "static", "maxConcurrent": 3},
            ]
        },
    )
    loose = run_cli("check-config", "--config", str(cfg))
    assert loose.returncode == 0, loose.stderr
    strict = run_cli("check-config", "--config", str(cfg), "--strict")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "Traceback" not in strict.stderr
    problems = [line for line in strict.stdout.splitlines() if line.startswith("  problem: ")]
    text = "\n".join(problems)
    assert "maxConcurrent" in text
    assert "credentialFile 'relative.key' must be an absolute path" in text
    assert "models is empty" in text
    assert "inference.example" in text and "tailnet" in text
    assert len(problems) == 4

    doc = json.loads(run_cli("check-config", "--config", str(cfg), "--json").stdout)
    broken = next(p for p in doc["providers"] if p["id"] == "broken")
    assert len(broken["problems"]) == 4 and not broken["discovery_active"]


def test_strict_exits_0_when_every_requested_discovery_is_possible(
    tmp_path: Path, write_config: WriteConfig
) -> None:
    key = tmp_path / "k.key"
    key.write_text("sk-strict-ok\n")
    key.chmod(0o600)
    cfg = write_config(
        {
            "providers": [
                _on_loopback(key),
                {"id": "static"},
            ]
        },
    )
    out = run_cli("check-config", "--config", str(cfg), "--strict")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "loop: discovery would be ACTIVE" in out.stdout


def test_strict_counts_a_key_file_it_cannot_read(tmp_path: Path, write_config: WriteConfig) -> None:
    cfg = write_config(
        {"providers": [_on_loopback(tmp_path / "missing.key")]},
    )
    out = run_cli("check-config", "--config", str(cfg), "--strict")
    assert out.returncode == 1
    assert "credential_error:" in out.stdout and "missing.key" in out.stdout


def test_check_config_names_the_segment_and_what_it_derives_from(write_config: WriteConfig) -> None:
    cfg = write_config({"providers": [{"id": "p"}]})
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CAPACITY_SEGMENT"}
    out = run_cli("check-config", "--config", str(cfg), env=env)
    assert out.returncode == 0, out.stderr
    expected = segment_name_for_config(cfg)
    assert f"segment {expected} (from the config path {os.path.abspath(cfg)})" in out.stdout

    env["GATEWAY_CAPACITY_SEGMENT"] = "/gw-named-a"
    doc = json.loads(run_cli("check-config", "--config", str(cfg), "--json", env=env).stdout)
    assert doc["segment"] == "/gw-named-a"
    assert doc["segment_from"] == "$GATEWAY_CAPACITY_SEGMENT"


def test_r_c3_a_config_saved_with_a_utf8_bom_is_read(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.json"
    cfg.write_bytes(b"\xef\xbb\xbf" + json.dumps({"providers": [{"id": "bom"}]}).encode())
    out = run_cli("check-config", "--config", str(cfg), "--strict")
    assert out.returncode == 0, out.stderr
    assert "bom: static limit" in out.stdout
