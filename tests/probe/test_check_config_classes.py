"""check-config on a provider's admission classes, run as an operator runs it: the classes
it read, every problem of a bad entry at once, typos inside a class named with the key
they resemble, and a class mistake costing the classes, never discovery (R-A17, R-C3)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gwtest import run_cli


def _entry(key_file: Path, **fields: Any) -> dict[str, Any]:
    return {
        "id": "p1",
        "baseUrl": "http://127.0.0.1:8731/v1",
        "credentialFile": str(key_file),
        "capacityDiscovery": True,
        "models": {"w": "workhorse"},
        **fields,
    }


def test_r_a17_check_config_shows_the_classes_it_read(
    write_config: Callable[..., Path], key_file: Path
) -> None:
    classes = [
        {"name": "interactive", "reserve": 2, "maxWait": 5},
        {"name": "batch", "cap": 6},
    ]
    config = write_config({"providers": [_entry(key_file, classes=classes)]})
    out = run_cli("check-config", "--config", str(config), "--strict")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "  classes, highest first: interactive (reserve 2, no cap, maxWait 5 s); "
        "batch (default, reserve 0, cap 6)"
    ) in out.stdout.splitlines(), out.stdout
    doc = json.loads(run_cli("check-config", "--config", str(config), "--json").stdout)
    shown = doc["providers"][0]["classes"]
    assert shown == [
        {"name": "interactive", "reserve": 2, "cap": None, "max_wait": 5, "default": False},
        {"name": "batch", "reserve": 0, "cap": 6, "max_wait": None, "default": True},
    ]


def test_r_a17_a_typo_inside_a_class_is_named_with_the_key_it_resembles_and_strict_fails(
    write_config: Callable[..., Path], key_file: Path
) -> None:
    classes = [{"name": "interactive", "reserv": 2}, {"name": "batch", "maxwait": 30}]
    config = write_config({"providers": [_entry(key_file, classes=classes)]})
    out = run_cli("check-config", "--config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr  # ignored, as every unknown key
    lines = out.stdout.splitlines()
    assert (
        "unknown key 'reserv' in providers[0] (p1).classes[0]; did you mean reserve? (ignored)"
    ) in lines, out.stdout
    assert (
        "unknown key 'maxwait' in providers[0] (p1).classes[1]; did you mean maxWait? (ignored)"
    ) in lines, out.stdout
    strict = run_cli("check-config", "--config", str(config), "--strict")
    assert strict.returncode == 1, strict.stdout


def test_r_c3_every_class_problem_is_reported_and_costs_the_classes_not_discovery(
    write_config: Callable[..., Path], key_file: Path
) -> None:
    classes = [
        {"name": "interactive", "reserve": "2", "cap": 0},
        {"name": "batch"},
        {"name": "batch", "maxWait": -1},
        {"reserve": 1},
    ]
    config = write_config({"providers": [_entry(key_file, classes=classes, defaultClass="Batch")]})
    out = run_cli("check-config", "--config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    head = next(x for x in lines if x.startswith("p1: "))
    assert head.startswith("p1: discovery would be ACTIVE"), out.stdout  # not REFUSED
    at = lines.index("  classes: REFUSED, it admits as one queue (no reserve, no cap) until fixed:")
    problems = [x.removeprefix("    problem: ") for x in lines[at + 1 :] if x.startswith("    ")]
    assert problems == [
        "classes[0].reserve: expected `int`, got `str`",
        "classes[0].cap: expected `int` >= 1",
        "classes[2].maxWait: expected `float` > 0.0",
        "classes[3]: name is required",
        "classes: the name 'batch' is given 2 times (every class needs a name of its own)",
        "defaultClass 'Batch' is not one of the classes (interactive, batch); "
        "did you mean 'batch'?",
    ], out.stdout
    strict = run_cli("check-config", "--config", str(config), "--strict")
    assert strict.returncode == 1
    doc = json.loads(run_cli("check-config", "--config", str(config), "--json").stdout)
    p1 = doc["providers"][0]
    assert p1["discovery_active"] is True and p1["classes"] == []
    assert len(p1["class_problems"]) == 6


def test_r_c3_a_mistyped_capacity_discovery_is_refused_not_unrequested(
    write_config: Callable[..., Path], key_file: Path
) -> None:
    config = write_config({"providers": [_entry(key_file, capacityDiscovery="yes")]})
    out = run_cli("check-config", "--config", str(config))
    head = next(x for x in out.stdout.splitlines() if x.startswith("p1: "))
    assert head.startswith("p1: discovery REFUSED, static limit"), out.stdout
    assert "capacityDiscovery: expected `bool`, got `str`" in out.stdout
    assert run_cli("check-config", "--config", str(config), "--strict").returncode == 1
