"""The sidecar writes each provider's admission classes from the gateway config into the
segment and follows edits of them live (R-A17, R-A21, R-C4); with share mode or discovery
they apply to whatever limit is published (R-A23)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gwtest import Agent
from sidecar_e2e import StartSidecar, wait_provider

from shm_layout.view import read_view


def _names(p: dict[str, Any]) -> list[tuple[str, int, bool]]:
    return [(c["name"], c["reserve"], c["default"]) for c in p["classes"]]


def test_r_a17_r_c4_the_sidecar_writes_the_classes_and_follows_their_edits(
    segment_name: str, write_config: Callable[..., Path], start_sidecar: StartSidecar
) -> None:
    classes = [{"name": "interactive", "reserve": 2}, {"name": "batch", "cap": 3, "maxWait": 30}]
    doc: dict[str, Any] = {"providers": [{"id": "p1", "maxConcurrent": 6, "classes": classes}]}
    config = write_config(doc)
    start_sidecar(config, segment_name)
    p = wait_provider(segment_name, "p1", lambda p: bool(p["classes"]), what="classes written")
    assert _names(p) == [("interactive", 2, False), ("batch", 0, True)]
    assert p["classes"][1]["cap"] == 3 and p["classes"][1]["max_wait_s"] == 30.0
    doc["providers"][0]["defaultClass"] = "interactive"
    doc["providers"][0]["classes"] = classes[:1]
    config.write_text(json.dumps(doc))
    p = wait_provider(
        segment_name, "p1", lambda p: len(p["classes"]) == 1, timeout=10, what="edit followed"
    )
    assert _names(p) == [("interactive", 2, True)]
    del doc["providers"][0]["classes"]
    config.write_text(json.dumps(doc))
    wait_provider(segment_name, "p1", lambda p: p["classes"] == [], what="back to one FIFO")


def test_r_a17_metrics_count_running_and_waiting_per_class(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    from prometheus_client import generate_latest

    from handler_shim import Admission
    from sidecar.metrics import SidecarMetrics, build_registry

    classes = [{"name": "interactive", "reserve": 1}, {"name": "batch"}]
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 2, "classes": classes}]})
    adm = Admission.attach(config=config, segment=segment_name, generation="t")
    try:
        held = [adm.try_acquire("p1", cls="batch"), adm.try_acquire("p1", cls="interactive")]
        assert all(held) and adm.try_acquire("p1", cls="batch") is None  # the reserve
        text = generate_latest(build_registry(segment_name, SidecarMetrics())).decode()
        assert 'gateway_capacity_class_running{class="batch",provider="p1"} 1.0' in text
        assert 'gateway_capacity_class_running{class="interactive",provider="p1"} 1.0' in text
        assert 'gateway_capacity_requests_displaced_total{provider="p1"} 0.0' in text
        for ticket in held:
            assert ticket is not None
            adm.release(ticket)
    finally:
        adm.close()


def test_r_a17_check_config_names_a_bad_class_entry_in_one_line() -> None:
    """Each class field may be right alone and wrong together (a defaultClass that is none
    of the classes): said as the entry's problem, never a traceback."""
    from sidecar.config import provider_problems

    entry = {"id": "p1", "classes": [{"name": "a"}, {"name": "b"}], "defaultClass": "c"}
    provider, problems = provider_problems(entry)
    assert problems == ["config_invalid:defaultClass 'c' is not one of the classes"]
    assert [c.name for c in provider.classes] == ["a", "b"] and provider.default_class is None
    _, problems = provider_problems({"id": "p2", "classes": [{"name": "a"}, {"name": "a"}]})
    assert problems == ["config_invalid:classes: every class needs a name of its own"]


def test_r_a18_an_edit_adding_a_class_above_running_requests_keeps_them_in_their_class(
    segment_name: str,
    write_config: Callable[..., Path],
    start_sidecar: StartSidecar,
    agents: Callable[..., Agent],
) -> None:
    """Two batch requests run; the config is edited to put a class above the others. The
    sidecar's rewrite of the table keeps them batch: a third batch arrival waits (L - (1
    + 1) = 2 already run) and an interactive arrival runs at once."""
    classes: list[dict[str, Any]] = [{"name": "interactive", "reserve": 1}, {"name": "batch"}]
    doc: dict[str, Any] = {"providers": [{"id": "p1", "maxConcurrent": 4, "classes": classes}]}
    config = write_config(doc)
    start_sidecar(config, segment_name)
    wait_provider(segment_name, "p1", lambda p: bool(p["classes"]), what="classes written")

    def handler(cls: str, *extra: str) -> Agent:
        return agents("--segment", segment_name, "--config", str(config), "--cls", cls, *extra)

    batch = handler("batch", "hold", "--threads", "2")
    batch.expect("admitted")
    batch.expect("admitted")
    doc["providers"][0]["classes"] = [{"name": "vip", "reserve": 1}, *classes]
    config.write_text(json.dumps(doc))
    wait_provider(segment_name, "p1", lambda p: len(p["classes"]) == 3, what="edit followed")
    p1 = read_view(segment_name).provider("p1")
    assert p1 is not None
    assert {c.name: c.running for c in p1.classes} == {"vip": 0, "interactive": 0, "batch": 2}
    handler("batch", "hold", "--timeout", "1.5").expect("timeout", timeout=10.0)
    handler("interactive", "hold", "--timeout", "5").expect("admitted", timeout=10.0)
