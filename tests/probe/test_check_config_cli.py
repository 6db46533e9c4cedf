"""``gateway-capacity check-config`` through the installed CLI, as an operator runs it.

The subprocess runs while our own loopback servers (a would-be provider and a
fake tailscaled LocalAPI) serve in this process, so the test can assert what
check-config asked and that it sent nothing to the provider.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from probe_servers import FakeLocalAPI, RawServer, body_of, fixed, snapshot

CLI = str(Path(sys.executable).parent / "gateway-capacity")


async def run_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def provider(pid: str, base_url: str, key_file: Path, **fields: Any) -> dict[str, Any]:
    entry = {
        "id": pid,
        "type": "chat-completions-api",
        "baseUrl": base_url,
        "credentialFile": str(key_file),
        "capacityDiscovery": True,
        "models": {"alias": "workhorse"},
        "unknownField": {"kept": True},
    }
    entry.update(fields)
    return entry


def test_check_config_reports_every_provider_and_sends_nothing(
    tmp_path: Path, key: str, key_file: Path
) -> None:
    sock = tmp_path / "ts.sock"
    loose_key = tmp_path / "loose.key"
    loose_key.write_text(key + "\n")
    loose_key.chmod(0o644)

    async def scenario() -> tuple[int, str, str, int, list[tuple[str, str]], str]:
        async with (
            RawServer(fixed(200, body_of(snapshot(0.0)))) as router,
            FakeLocalAPI(sock, {"100.101.102.103": "router.tailnet.ts.net"}) as api,
        ):
            doc = {
                "maxConcurrent": 8,
                "providers": [
                    provider("loop", f"http://{router.netloc}/v1", key_file, maxConcurrent=12),
                    provider("peer", "https://100.101.102.103/v1", key_file, tailnet=True),
                    provider("stranger", "https://100.101.102.104/v1", key_file, tailnet=True),
                    provider("public", "https://api.example.com/v1", key_file),
                    provider("loose", f"http://{router.netloc}/v1", loose_key),
                    {"id": "static", "maxConcurrent": 2},
                    provider("broken", "http://127.0.0.1/v1", key_file, tailnet="yes"),
                    {"no": "id"},
                ],
            }
            config = tmp_path / "gateway.json"
            config.write_text(json.dumps(doc))
            code, out, err = await run_cli(
                "check-config", "--config", str(config), "--json", "--tailscale-socket", str(sock)
            )
            _, text, _ = await run_cli(
                "check-config", "--config", str(config), "--tailscale-socket", str(sock)
            )
            return code, out, err, router.connections, api.requests, text

    code, out, err, router_connections, whois_requests, text = asyncio.run(scenario())
    assert code == 0, err
    assert router_connections == 0  # check-config never talks to a provider
    report = json.loads(out)
    by_id = {p["id"]: p for p in report["providers"]}
    assert report["max_concurrent"] == 8

    loop = by_id["loop"]
    assert loop["discovery_active"] is True and loop["reason"] == "opt_in_ok:loopback"
    assert (loop["fallback_limit"], loop["fallback_source"]) == (12, "provider")
    assert loop["addresses"] == [{"address": "127.0.0.1", "allowed": True, "detail": "loopback"}]
    assert loop["credential"] == "ok"
    assert loop["endpoint"].endswith("/v1/capacity")

    peer = by_id["peer"]
    assert peer["discovery_active"] is True
    assert peer["addresses"][0]["detail"] == "tailnet peer router.tailnet.ts.net"

    stranger = by_id["stranger"]
    assert stranger["discovery_active"] is False
    assert stranger["reason"].startswith("address_refused:") and "not a peer" in stranger["reason"]

    assert by_id["public"]["reason"].startswith("opt_in_refused:")
    assert by_id["loose"]["reason"].startswith("credential_error:")
    assert "chmod 600" in by_id["loose"]["reason"]
    static = by_id["static"]
    assert (static["discovery_requested"], static["reason"]) == (False, "not_requested")
    assert (static["fallback_limit"], static["fallback_source"]) == (2, "provider")
    assert by_id["broken"]["reason"].startswith("config_invalid:tailnet")
    assert report["skipped"] == ["providers[7]: id is missing or not a string (entry skipped)"]
    assert sorted(t for t, _ in whois_requests) == [
        "/localapi/v0/whois?addr=100.101.102.103%3A443",
        "/localapi/v0/whois?addr=100.101.102.103%3A443",
        "/localapi/v0/whois?addr=100.101.102.104%3A443",
        "/localapi/v0/whois?addr=100.101.102.104%3A443",
    ]  # JSON run and text run, one lookup per address each

    for pid in ("loop", "peer", "stranger", "public", "loose", "static", "broken"):
        assert f"{pid}: " in text
    assert "discovery would be ACTIVE" in text and "REFUSED" in text
    assert key not in out + err + text


def test_r_p1_check_config_without_tailscaled_refuses_the_tailnet_provider(
    tmp_path: Path, key_file: Path
) -> None:
    config = tmp_path / "gateway.json"
    config.write_text(
        json.dumps(
            {"providers": [provider("ts", "http://100.101.102.103/v1", key_file, tailnet=True)]}
        )
    )
    argv = ["--json", "--tailscale-socket", str(tmp_path / "absent.sock")]
    code, out, _ = asyncio.run(run_cli("check-config", "--config", str(config), *argv))
    assert code == 0
    (entry,) = json.loads(out)["providers"]
    assert entry["discovery_active"] is False
    assert "tailscaled cannot vouch" in entry["reason"]
    code, _, _ = asyncio.run(run_cli("check-config", "--config", str(config), "--strict", *argv))
    assert code == 1


def test_r_p1_check_config_shows_a_range_only_tailnet_check(tmp_path: Path, key_file: Path) -> None:
    config = tmp_path / "gateway.json"
    entry_doc = provider("ts", "http://100.101.102.103/v1", key_file, tailnet=True)
    entry_doc["tailnetCheck"] = "range-only"
    config.write_text(json.dumps({"providers": [entry_doc]}))
    code, out, _ = asyncio.run(
        run_cli(
            "check-config",
            "--config",
            str(config),
            "--json",
            "--tailscale-socket",
            str(tmp_path / "absent.sock"),
        )
    )
    assert code == 0
    (entry,) = json.loads(out)["providers"]
    assert entry["discovery_active"] is True
    assert entry["reason"].startswith("opt_in_ok:tailnet-range-only")
    assert "range-checked only (tailnetCheck: range-only" in entry["reason"]
    assert (entry["fallback_limit"], entry["fallback_source"]) == (4, "default")


def test_r_c3_check_config_exits_2_with_one_line_for_an_unreadable_or_broken_file(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"providers": [')
    for path in (broken, tmp_path / "absent.json"):
        code, out, err = asyncio.run(run_cli("check-config", "--config", str(path)))
        assert code == 2
        assert out == ""
        assert len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err
        assert str(path) in err
