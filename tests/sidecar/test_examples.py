"""examples/grafana-dashboard.json and examples/prometheus-alerts.yml use metrics that exist.

Every metric name they reference must be in a scrape of a real sidecar (with a
discovery provider, a static one and a handler holding a slot, so every family
has series). The alert rules and the dashboard's queries are checked by
``promtool check rules`` where ``scripts/ensure-tools`` could install it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from sidecar_e2e import STATIC, Rig
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


def test_every_metric_the_examples_use_exists_in_a_real_scrape(rig: Rig) -> None:
    sidecar = rig.start_discovered(rig.config(STATIC), "--metrics-listen", "127.0.0.1:0")
    rig.handler("--gen", "g1", "hold").expect("admitted")
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


def _series(text: str, used: set[str], later: str | None = None) -> list[dict[str, str]]:
    """promtool input series from real scrapes: gauges hold their value, a counter grows
    per minute by what it grew between the two scrapes (``text`` then ``later``)."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body)
            for s in f.samples
            if s.name in used
        }

    first = samples(text)
    second = samples(later) if later is not None else first
    out = []
    for (name, labels), value in sorted(second.items()):
        grown = value - first.get((name, labels), value)
        shown = {**dict(labels), "instance": "sidecar", "job": "gateway-capacity"}
        selector = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(shown.items())) + "}"
        values = f"{value:g}+{grown:g}x45" if name.endswith("_total") else f"{value:g}x45"
        out.append({"series": selector, "values": values})
    return out


def _fired(promtool: str, tmp_path: Path, series: list[dict[str, str]]) -> set[str]:
    """The alerts of examples/prometheus-alerts.yml firing after 40 minutes of ``series``."""
    names = [r["alert"] for r in alert_rules()]
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": f'count by (alertname) (ALERTS{{alertstate="firing",'
                        f'alertname="{name}"}}) > bool 0',
                        "eval_time": "40m",
                        "exp_samples": [{"labels": f'{{alertname="{name}"}}', "value": 1}],
                    }
                    for name in names
                ],
            }
        ],
    }
    path = tmp_path / f"alerts-test-{len(list(tmp_path.iterdir()))}.yml"
    path.write_text(yaml.safe_dump(tests))
    out = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    missing = set(re.findall(r'alertname="(\w+)"', out.stdout + out.stderr))
    assert out.returncode == 0 or missing, out.stdout + out.stderr
    return set(names) - missing


def test_every_documented_alert_fires_on_what_a_real_sidecar_exports(
    rig: Rig, tmp_path: Path
) -> None:
    """Each alert of examples/prometheus-alerts.yml (and docs/metrics.md) in the state it
    is about, produced for real: promtool evaluates the rules over the series a real
    sidecar exported (a gauge held, a counter growing as it grew between two scrapes)."""
    promtool = _promtool()
    segment_name = rig.segment
    failing = rig.servers(status=500)
    old = rig.servers(observed_offset=-25.0)  # valid, but 25 s old: the snapshot-age alert
    config = rig.write_config(
        {
            "maxConcurrent": 8,
            "providers": [
                rig.entry(old, "old"),
                rig.entry(failing, "failing"),  # discovery fails: on its fallback
                rig.entry("http://203.0.113.5:8080/v1", "refused"),  # opt-in refused
                {"id": "invalid", "capacityDiscovery": True},  # entry invalid: no baseUrl
                {"id": "full", "maxConcurrent": 0},  # nothing runs: the queue fills
            ],
        }
    )
    legacy = subprocess.Popen(["sleep", "600"])
    try:
        sidecar = rig.start(
            config, "--metrics-listen", "127.0.0.1:0", "--await-legacy", str(legacy.pid)
        )
        base = metrics_url(sidecar)
        rig.wait("old", lambda p: p["discovered"] == 20)
        used = {m for r in alert_rules() for m in METRIC.findall(r["expr"])}
        used |= {f"{m}_total" for m in used} | {m.removesuffix("_total") for m in used}
        first, _, _ = scrape(base)
        # between the two scrapes: counters that grow are what rate() and increase() see
        holder = rig.agents("--segment", segment_name, "--config", str(config), "lock")
        holder.expect("locked")
        holder.kill()  # died holding the segment lock: the next holder repairs
        crowd = rig.handler("hold", "--threads", "34", "--timeout", "1", provider="full")
        crowd.expect("queue_full")
        time.sleep(3.0)  # refreshes and timeouts before the next scrape
        config.write_text("{ broken")  # a broken edit: kept out, and said so
        wait_until = time.monotonic() + 10
        while "gateway_capacity_config_last_reload_successful 0.0" not in scrape(base)[0]:
            assert time.monotonic() < wait_until, "the broken edit was not noticed"
            time.sleep(0.2)
        third, _, _ = scrape(base)
        # the event loop stalls (a FIFO as the config blocks its read) while the metrics
        # thread still answers: the heartbeat ages
        config.unlink()
        os.mkfifo(config)
        time.sleep(7.0)
        stalled, _, _ = scrape(base)
        series = _merge(_series(first, used, third), stalled, used)
        up = [{"series": 'up{instance="sidecar",job="gateway-capacity"}', "values": "1x45"}]
        fired = _fired(promtool, tmp_path, series + up)
        # a refused opt-in and an invalid entry, each alone, leave a provider on its
        # fallback where the alert sees it (their probe_results_total series, one a refresh)
        for alone in ("refused", "invalid"):
            only = [
                x
                for x in series
                if "provider=" not in x["series"] or f'provider="{alone}"' in x["series"]
            ]
            assert "GatewayCapacityLimitOnFallback" in _fired(promtool, tmp_path, only + up), alone
        sidecar.kill()
        down = [{"series": 'up{instance="sidecar",job="gateway-capacity"}', "values": "0x45"}]
        fired |= _fired(promtool, tmp_path, down)
    finally:
        legacy.kill()
        legacy.wait()
    assert fired == {r["alert"] for r in alert_rules()}, sorted(
        {r["alert"] for r in alert_rules()} - fired
    )


def _merge(series: list[dict[str, str]], stalled: str, used: set[str]) -> list[dict[str, str]]:
    """``series`` with the heartbeat age as the stalled scrape showed it."""
    (age,) = [s for s in _series(stalled, used) if "sidecar_heartbeat_age_seconds" in s["series"]]
    return [s for s in series if "sidecar_heartbeat_age_seconds" not in s["series"]] + [age]
