"""``check-config --probe`` against the real capacity router, as a new operator runs it
before starting the sidecar: the real key, the probe's rules, and what to do."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router_support import KEY, worker

from capacity_router import RouterServer, SimWorker

CLI = str(Path(sys.executable).with_name("gateway-capacity"))


def check_config(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, "check-config", "--config", str(config), "--probe", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def entry(pid: str, base_url: str, key_file: Path, **fields: Any) -> dict[str, Any]:
    return {
        "id": pid,
        "baseUrl": base_url,
        "credentialFile": str(key_file),
        "capacityDiscovery": True,
        "models": {"local-workhorse": "wh"},
        **fields,
    }


def test_probe_reads_the_real_router_and_says_what_to_do_about_each_mistake(
    tmp_path: Path,
    key_file: Path,
    sim: Callable[..., SimWorker],
    router: Callable[..., RouterServer],
) -> None:
    w = sim(slots=6)
    r = router([worker("a", [w.url], ["wh"])])
    assert [m.id for m in r.observe().models] == ["wh"]
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text("not-the-router-key\n")
    wrong_key.chmod(0o600)
    doc = {
        "providers": [
            entry("good", f"{r.url}/v1", key_file),
            entry("no-v1", r.url, key_file),
            entry("wrong-key", f"{r.url}/v1", wrong_key),
            entry("typo-model", f"{r.url}/v1", key_file, models={"x": "wh", "y": "whorkhorse"}),
            entry("lan", "http://192.168.1.20:8731/v1", key_file),
        ]
    }
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps(doc))
    out = check_config(config)
    assert out.returncode == 1, out.stderr
    text = out.stdout
    assert KEY not in text and KEY not in out.stderr
    blocks = {b.split(":", 1)[0]: b for b in text.split("\n") if b and not b.startswith(" ")}
    assert "good: discovery would be ACTIVE" in blocks["good"]
    assert "    replica 127.0.0.1: ok, complete: wh 6" in text
    assert (
        f"{r.url}/capacity answered 404 and baseUrl {r.url} does not end with /v1: "
        "check the /v1 suffix" in text
    )
    assert "the router refused the key: credentialFile" in text
    assert "models names whorkhorse, which the router does not report" in text
    assert (
        "192.168.1.20 is neither loopback nor a Tailscale address; the key goes only to this "
        "host or a Tailscale peer: run the router here" in text
    )
    assert "probe: NOT SENT, for the reason above" in text

    report = json.loads(check_config(config, "--json").stdout)
    probes = {p["id"]: p["probe"] for p in report["providers"]}
    assert probes["good"]["ok"] is True and probes["good"]["replicas"][0]["models"] == {"wh": 6}
    assert probes["no-v1"]["replicas"][0]["reason"] == "no_endpoint"
    assert probes["wrong-key"]["replicas"][0]["reason"] == "auth_failed"
    assert probes["typo-model"]["missing_models"] == ["whorkhorse"]
    assert probes["lan"]["refused"].startswith("opt_in_refused:")

    good = tmp_path / "good.json"
    good.write_text(json.dumps({"providers": [doc["providers"][0]]}))
    assert check_config(good).returncode == 0


def test_a_probe_that_leaves_the_limit_at_0_is_not_ok_and_fails_the_check(
    tmp_path: Path,
    key_file: Path,
    sim: Callable[..., SimWorker],
    router: Callable[..., RouterServer],
) -> None:
    w = sim(slots=6)
    r = router([worker("a", [w.url], ["wh"])])
    assert [m.id for m in r.observe().models] == ["wh"]
    config = tmp_path / "gateway.json"
    models = {"small": "wh", "big": "workhorse-big"}  # the farm serves no workhorse-big
    config.write_text(
        json.dumps({"providers": [entry("p", f"{r.url}/v1", key_file, models=models)]})
    )
    out = check_config(config)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "  probe: ok" not in out.stdout
    assert (
        "  probe: NOT OK, answered but the limit would stay 0: no answer reports workhorse-big"
        in out.stdout
    )
    assert "models names workhorse-big, which the router does not report" in out.stdout
