"""``gateway-capacity verify`` compares a probe made now with the segment (section 8)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gwtest import provider_doc, run_cli, wait_until

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "sidecar"))
from capacity_server import CapacityServer


@pytest.fixture
def router() -> Iterator[tuple[CapacityServer, str]]:
    key = "sk-verify-" + secrets.token_hex(12)
    server = CapacityServer(key).start()
    yield server, key
    server.stop()


def test_verify_agrees_then_differs_and_never_shows_the_key(
    router: tuple[CapacityServer, str],
    segment_name: str,
    write_config: Callable[..., Path],
    tmp_path: Path,
) -> None:
    server, key = router
    key_file = tmp_path / "provider.key"
    key_file.write_text(key + "\r\n")
    key_file.chmod(0o600)
    cfg = write_config(
        {
            "maxConcurrent": 4,
            "providers": [
                {
                    "id": "li",
                    "baseUrl": server.base_url,
                    "credentialFile": str(key_file),
                    "capacityDiscovery": True,
                    "models": {"w": "workhorse"},
                },
                {"id": "static", "maxConcurrent": 3},
            ],
        }
    )
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway_capacity",
            "sidecar",
            "--config",
            str(cfg),
            "--segment",
            segment_name,
            "--refresh",
            "0.3",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_until(
            lambda: (
                run_cli("availability", "--segment", segment_name).returncode == 0
                and provider_doc(segment_name, "li")["effective_limit"] == 20
            )
        )
        ok = run_cli("verify", "--config", str(cfg), "--segment", segment_name, "--json")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        doc = json.loads(ok.stdout)
        rows = {r["id"]: r for r in doc["providers"]}
        assert rows["li"]["rules_limit"] == rows["li"]["segment_limit"] == 20
        assert rows["static"]["rules_limit"] == rows["static"]["segment_limit"] == 3
        assert key not in ok.stdout + ok.stderr

        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(timeout=10) == 0
        server.set(models={"workhorse": 10})  # the farm changed; nobody published it
        differs = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
        assert differs.returncode == 1
        assert "DIFFERS li: rules 10 (discovered), segment 20 (discovered)" in differs.stdout
        assert key not in differs.stdout + differs.stderr
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait()
        assert sidecar.stderr is not None
        assert key not in sidecar.stderr.read()


def test_verify_without_a_segment_exits_3(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    cfg = write_config({"providers": [{"id": "p"}]})
    out = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
    assert out.returncode == 3 and "Traceback" not in out.stderr


def _sidecar(cfg: Path, segment: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway_capacity", "sidecar", "--config", str(cfg),
         "--segment", segment, "--refresh", "0.3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _opted_in(server: CapacityServer, key_file: Path, models: dict[str, str]) -> dict[str, object]:
    return {
        "id": "li",
        "baseUrl": server.base_url,
        "credentialFile": str(key_file),
        "capacityDiscovery": True,
        "models": models,
    }


def test_r_l3_a_model_typo_is_a_sidecar_warning_and_verify_exits_1(
    router: tuple[CapacityServer, str],
    segment_name: str,
    write_config: Callable[..., Path],
    tmp_path: Path,
) -> None:
    server, key = router
    key_file = tmp_path / "provider.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    # the router serves "workhorse"; the config asks for "workhors"
    cfg = write_config(
        {"maxConcurrent": 4, "providers": [_opted_in(server, key_file, {"w": "workhors"})]}
    )
    sidecar = _sidecar(cfg, segment_name)
    try:
        assert wait_until(
            lambda: (
                run_cli("availability", "--segment", segment_name).returncode == 0
                and "workhors " in provider_doc(segment_name, "li")["reason"]
            ),
            timeout=30,
        )
        doc = provider_doc(segment_name, "li")
        assert doc["effective_limit"] == 0 and doc["source"] == "discovered"
        out = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "MISSING MODEL li" in out.stdout
        assert "the router does not report workhors" in out.stdout
        doc = json.loads(
            run_cli("verify", "--config", str(cfg), "--segment", segment_name, "--json").stdout
        )
        assert doc["ok"] is False and doc["providers"][0]["missing_models"] == ["workhors"]
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=20)
        assert sidecar.stderr is not None
        log = sidecar.stderr.read()
    warnings = [line for line in log.splitlines() if " WARNING " in line and "workhors " in line]
    assert warnings, log
    assert "upstream model workhors missing from 127.0.0.1" in warnings[0]
    assert key not in log


@pytest.mark.parametrize("failure", ["router_down", "404"])
def test_verify_that_could_not_compare_exits_2_never_ok(
    failure: str,
    router: tuple[CapacityServer, str],
    segment_name: str,
    write_config: Callable[..., Path],
    tmp_path: Path,
) -> None:
    server, key = router
    key_file = tmp_path / "provider.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    cfg = write_config(
        {"maxConcurrent": 4, "providers": [_opted_in(server, key_file, {"w": "workhorse"})]}
    )
    # a segment as a handler leaves it (no sidecar): fallback 4, which is also what the
    # rules give when nothing answers, so a naive comparison would say "ok"
    attach = run_cli("availability", "--segment", segment_name)
    assert attach.returncode == 3
    subprocess.run(
        [sys.executable, "-c",
         "import sys; from handler_shim import Admission; "
         "Admission.attach(config=sys.argv[1], segment=sys.argv[2]).close()",
         str(cfg), segment_name],
        check=True, timeout=60,
    )  # fmt: skip
    if failure == "router_down":
        server.stop()
    else:
        server.set(status=404)
    out = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "NO ANSWER li" in out.stdout and "could not compare" in out.stdout
    assert not out.stdout.startswith("ok")
    assert key not in out.stdout + out.stderr


def test_an_unreachable_router_is_named_by_its_url_with_the_port_and_a_missing_value_is_a_dash(
    router: tuple[CapacityServer, str],
    segment_name: str,
    write_config: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """Issue 18 item 7: "127.0.0.1 unreachable" named no port, and verify printed
    ``value None`` where availability prints ``value -``."""
    server, key = router
    key_file = tmp_path / "provider.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    cfg = write_config({"providers": [_opted_in(server, key_file, {"w": "workhorse"})]})
    subprocess.run(
        [sys.executable, "-c",
         "import sys; from handler_shim import Admission; "
         "Admission.attach(config=sys.argv[1], segment=sys.argv[2]).close()",
         str(cfg), segment_name],
        check=True, timeout=60,
    )  # fmt: skip
    server.stop()  # nothing listens on its port now
    out = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
    assert out.returncode == 2
    url = f"{server.base_url}/capacity"
    assert f"127.0.0.1 unreachable ({url}: ConnectError" in out.stdout
    assert "replica 127.0.0.1: unreachable value -" in out.stdout
    assert "None" not in out.stdout
    doc = json.loads(
        run_cli("verify", "--config", str(cfg), "--segment", segment_name, "--json").stdout
    )
    assert doc["schema_version"] == 1 and doc["providers"][0]["replicas"][0]["value"] is None
    assert url in doc["providers"][0]["rules_reason"]


def _source(segment: str, provider: str) -> str | None:
    out = run_cli("availability", "--segment", segment, "--json")
    if out.returncode != 0:
        return None  # the sidecar has not made the segment yet
    return next(
        (p["source"] for p in json.loads(out.stdout)["providers"] if p["id"] == provider), None
    )


def test_verify_and_check_config_with_a_segment_alone_use_the_config_it_was_made_for(
    router: tuple[CapacityServer, str],
    segment_name: str,
    write_config: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """README: every command takes --config PATH or --segment NAME; the segment records
    the config path its sidecar was started with."""
    server, key = router
    key_file = tmp_path / "provider.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    cfg = write_config({"providers": [_opted_in(server, key_file, {"w": "workhorse"})]})
    sidecar = _sidecar(cfg, segment_name)
    try:
        assert wait_until(lambda: _source(segment_name, "li") == "discovered")
        short = segment_name.removeprefix("/")  # as `ls /dev/shm` lists it
        verified = run_cli("verify", "--segment", short)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert verified.stdout.startswith("ok  li: rules 20 (discovered)")
        checked = run_cli("check-config", "--segment", short, "--json")
        assert checked.returncode == 0, checked.stderr
        report = json.loads(checked.stdout)
        assert report["config"] == str(cfg) and report["segment_from"] == "--segment"
        assert report["providers"][0]["discovery_active"] is True
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=20)
    nothing = run_cli("check-config", "--segment", "/gwt-none-" + secrets.token_hex(4))
    assert nothing.returncode == 3 and "Traceback" not in nothing.stderr
