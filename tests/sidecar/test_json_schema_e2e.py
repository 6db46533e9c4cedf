"""``availability --json`` and ``inspect --json`` carry ``schema_version`` and match the
JSON Schemas in docs/schemas, which are generated from ``gateway_capacity.schemas``."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from capacity_server import CapacityServer
from sidecar_e2e import EXE, SidecarProc, discovered, wait_provider

from gateway_capacity.schemas import SCHEMA_VERSION, schema_texts

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "docs" / "schemas"


def test_committed_schemas_are_what_the_structs_generate() -> None:
    generated = schema_texts()
    committed = {p.name: p.read_text() for p in SCHEMAS.glob("*.schema.json")}
    assert set(committed) == set(generated), "run: make schemas"
    for name, text in generated.items():
        assert committed[name] == text, f"docs/schemas/{name} is out of date: run make schemas"


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object closed, so an undeclared output field fails too."""
    closed = copy.deepcopy(schema)
    for definition in closed["$defs"].values():
        if definition.get("type") == "object":
            definition["additionalProperties"] = False
    return closed


def validate(name: str, doc: dict[str, Any]) -> None:
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    for s in (schema, _closed(schema)):
        errors = sorted(jsonschema.Draft202012Validator(s).iter_errors(doc), key=str)
        assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def cli_json(*args: str) -> dict[str, Any]:
    out = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_real_availability_and_inspect_output_validate_against_the_schemas(
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
    start_sidecar(config, segment_name)
    wait_provider(segment_name, "p1", discovered(20))
    holder = agents("--segment", segment_name, "--provider", "static", "--gen", "g1", "hold")
    holder.expect("admitted")

    available = cli_json("availability", "--json", "--segment", segment_name)
    inspected = cli_json("inspect", "--json", "--segment", segment_name)
    validate("availability", available)
    validate("inspect", inspected)
    # what the validation covered: every nested object with a value, nulls as well
    assert available["schema_version"] == inspected["schema_version"] == SCHEMA_VERSION
    assert available["sidecar"]["alive"] is True
    p1 = next(p for p in inspected["providers"] if p["id"] == "p1")
    static = next(p for p in inspected["providers"] if p["id"] == "static")
    assert p1["replicas"] and p1["discovered"] == 20 and p1["expires_at"] is not None
    assert static["discovered"] is None and static["expires_at"] is None
    assert [h["state"] for h in inspected["holders"]] == ["running"]
    assert inspected["generations"][0]["generation"] == "g1"
    assert inspected["header"]["config_path"] == available["config_path"] == str(config)


@pytest.mark.parametrize("broken", ["wrong type", "missing field", "unknown source"])
def test_the_schema_check_fails_on_a_doc_that_does_not_match(broken: str) -> None:
    """The validation above can fail: the same kind of doc, broken three ways."""
    doc: dict[str, Any] = {
        "schema_version": 1,
        "segment": "/gwcap1-000000000000",
        "config_path": None,
        "layout": {"major": 1, "minor": 0},
        "consistent": True,
        "config_status": None,
        "sidecar": None,
        "owner": "gateway-capacity:gateway-capacity",
        "damage": None,
        "lock_problem": None,
        "generations": [],
        "providers": [
            {
                "id": "p",
                "capacity_discovery": False,
                "configured": True,
                "effective_limit": 4,
                "source": "default",
                "reason": "r",
                "running": 0,
                "waiting": 0,
                "queue_bound": 32,
                "fallback_limit": 4,
                "fallback_source": "default",
                "discovered": None,
                "observed_at": None,
                "expires_at": None,
                "replicas": [],
            }
        ],
    }
    validate("availability", doc)
    if broken == "wrong type":
        doc["providers"][0]["effective_limit"] = "4"
    elif broken == "missing field":
        del doc["schema_version"]
    else:
        doc["providers"][0]["source"] = "guessed"
    with pytest.raises(AssertionError):
        validate("availability", doc)


def test_a_segment_no_sidecar_has_written_validates_too(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Any]
) -> None:
    config = write_config({"maxConcurrent": 2, "providers": [{"id": "p1"}]})
    holder = agents("--config", str(config), "--segment", segment_name, "--provider", "p1", "hold")
    holder.expect("admitted")
    doc = cli_json("availability", "--json", "--segment", segment_name)
    validate("availability", doc)
    assert doc["sidecar"] is None
    validate("inspect", cli_json("inspect", "--json", "--segment", segment_name))
