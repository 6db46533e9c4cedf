"""examples/grafana-dashboard.json and examples/prometheus-alerts.yml use metrics that exist.

Every metric name they reference must be in a scrape of a real sidecar (with a
discovery provider, a static one and a handler holding a slot, so every family
has series). The alert rules and the dashboard's queries are checked by
``promtool check rules`` where ``scripts/ensure-tools`` could install it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from capacity_server import CapacityServer
from sidecar_e2e import SidecarProc, discovered, wait_provider
from test_metrics_e2e import metrics_url, scrape

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana-dashboard.json"
ALERTS = ROOT / "examples" / "prometheus-alerts.yml"
METRIC = re.compile(r"\b((?:gateway_capacity|process)_[a-z0-9_]+)")
# made by Prometheus itself for every target, not by the sidecar
SYNTHETIC = {"up"}


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_examples_are_well_formed() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] and isinstance(doc["schemaVersion"], int)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 8
    for panel in doc["panels"]:
        assert panel["targets"] and {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel
        assert panel["datasource"]["uid"] == "${datasource}"  # picks the user's Prometheus
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    assert {v["name"] for v in doc["templating"]["list"]} >= {"datasource", "provider"}

    rules = alert_rules()
    assert len(rules) >= 8
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule
        assert rule["annotations"]["summary"], rule


def test_every_metric_the_examples_use_exists_in_a_real_scrape(
    segment_name: str,
    write_config: Callable[..., Path],
    capacity: CapacityServer,
    entry: Callable[..., dict[str, Any]],
    start_sidecar: Callable[..., SidecarProc],
    agents: Callable[..., Any],
) -> None:
    config = write_config(
        {"maxConcurrent": 8, "providers": [entry(capacity), {"id": "static", "maxConcurrent": 3}]}
    )
    sidecar = start_sidecar(config, segment_name, "--metrics-listen", "127.0.0.1:0")
    wait_provider(segment_name, "p1", discovered(20))
    agents("--segment", segment_name, "--provider", "p1", "--gen", "g1", "hold").expect("admitted")
    _, families, samples = scrape(metrics_url(sidecar))
    scraped = set(families) | {name for name, _ in samples}

    used: dict[str, set[str]] = {}
    for where, exprs in (
        ("grafana-dashboard.json", dashboard_exprs()),
        ("prometheus-alerts.yml", [r["expr"] for r in alert_rules()]),
    ):
        names = {m for e in exprs for m in METRIC.findall(e)}
        assert names, where
        used[where] = names
        missing = sorted(names - scraped)
        assert not missing, f"{where} uses metrics a sidecar does not export: {missing}"
    # the examples cover what an operator watches first
    everything = used["grafana-dashboard.json"] | used["prometheus-alerts.yml"]
    for needed in (
        "gateway_capacity_effective_limit",
        "gateway_capacity_running",
        "gateway_capacity_waiting",
        "gateway_capacity_probe_results_total",
        "gateway_capacity_sidecar_heartbeat_age_seconds",
    ):
        assert needed in everything, needed
    other = {
        w
        for e in [r["expr"] for r in alert_rules()]
        for w in re.findall(r"\b([a-z_]+)\{", e)
        if not w.startswith(("gateway_capacity_", "process_"))
    }
    assert other <= SYNTHETIC, other


def _promtool() -> str:
    found = shutil.which("promtool") or str(Path(sys.executable).with_name("promtool"))
    if not Path(found).is_file():
        pytest.skip("promtool is not installed (scripts/ensure-tools fetches it as root with apt)")
    return found


def test_promtool_accepts_the_alert_rules_and_the_dashboard_queries(tmp_path: Path) -> None:
    promtool = _promtool()
    out = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout

    # Grafana's variables replaced by what they stand for, each query a recording rule
    rules = []
    for n, expr in enumerate(dashboard_exprs()):
        expr = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
        expr = expr.replace("$provider", ".*")
        if expr.startswith("label_values("):  # a Grafana function: check its selector
            expr = expr.removeprefix("label_values(").rsplit(",", 1)[0]
        rules.append({"record": f"dashboard:query_{n}", "expr": expr})
    checked = tmp_path / "dashboard-queries.yml"
    checked.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(
        [promtool, "check", "rules", str(checked)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_check_can_fail(tmp_path: Path) -> None:
    promtool = _promtool()
    broken = tmp_path / "broken.yml"
    broken.write_text(ALERTS.read_text().replace("> 5", "> > 5", 1))
    out = subprocess.run(
        [promtool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
