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
from sidecar_e2e import EXE, STATIC, Rig

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


def test_real_availability_and_inspect_output_validate_against_the_schemas(rig: Rig) -> None:
    config = rig.config(STATIC)
    rig.start_discovered(config)
    holder = rig.handler("--gen", "g1", "hold", provider="static")
    holder.expect("admitted")

    available = cli_json("availability", "--json", "--segment", rig.segment)
    inspected = cli_json("inspect", "--json", "--segment", rig.segment)
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


# Every subcommand with --json, and the schemas of what it prints (errors: error.schema.json).
JSON_COMMANDS = {
    "availability": ("availability", "availability-check"),
    "inspect": ("inspect",),
    "segments": ("segments",),
    "check-config": ("check-config",),
    "verify": ("verify",),
    "wait-for-slot": ("wait-for-slot",),
    "router show": ("router-show",),
    "router fence": ("router-fence",),
    "router unfence": ("router-fence",),
    "demo": ("demo",),
}


def test_every_subcommand_with_json_has_a_schema_and_every_property_a_description() -> None:
    import argparse

    from gateway_capacity.cli import build_parser

    found: set[str] = set()

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if "--json" in action.option_strings:
                found.add(path)
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}".strip())

    walk(build_parser(), "")
    assert found == set(JSON_COMMANDS)
    named = {n for names in JSON_COMMANDS.values() for n in names} | {"error"}
    assert {p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json")} == named

    undescribed: list[str] = []
    for path in SCHEMAS.glob("*.schema.json"):
        schema = json.loads(path.read_text())
        defs = schema.get("$defs", {})
        for where, definition in [("", schema), *defs.items()]:
            for prop, spec in definition.get("properties", {}).items():
                target = spec
                ref = spec.get("$ref") or next(
                    (s.get("$ref") for s in spec.get("anyOf", []) if "$ref" in s), None
                )
                if ref and "description" not in spec:
                    target = defs[ref.rsplit("/", 1)[1]]
                if not target.get("description"):
                    undescribed.append(f"{path.name}: {where or 'top'}.{prop}")
    assert not undescribed, "\n".join(undescribed)  # docs/json-output.md: every field


def cli_doc(*args: str, code: int = 0) -> dict[str, Any]:
    out = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stdout + out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    assert doc["schema_version"] == SCHEMA_VERSION, doc
    return doc


def test_every_json_output_carries_schema_version_and_validates(rig: Rig, tmp_path: Path) -> None:
    from capacity_router import RouterServer, SimWorker

    config = rig.config(STATIC)
    rig.start_discovered(config)
    seg = ("--segment", rig.segment)

    validate("availability-check", cli_doc("availability", "--check", "--json", *seg))
    validate("check-config", cli_doc("check-config", "--config", str(config), "--json"))
    validate("segments", cli_doc("segments", "--json"))
    validate("verify", cli_doc("verify", "--config", str(config), *seg, "--json"))
    local = ("wait-for-slot", *seg, "--provider", "static", "--json")
    validate("wait-for-slot", cli_doc(*local, "--check"))
    validate("wait-for-slot", cli_doc(*local, "--need", "9", code=2))  # the error form
    validate("error", cli_doc("availability", "--json", "--segment", "/gwt-none", code=3))
    validate("error", cli_doc("check-config", "--json", "--config", str(tmp_path), code=2))

    key = tmp_path / "router.key"
    key.write_text("router-json-key\n")
    key.chmod(0o600)
    with SimWorker(slots=4) as worker:
        registry = tmp_path / "workers.json"
        registry.write_text(
            json.dumps(
                {
                    "workers": [
                        {
                            "id": "w1",
                            "urls": [worker.url],
                            "models": ["workhorse"],
                            "slots": {"source": "props"},
                        }
                    ]
                }
            )
        )
        with RouterServer(registry, key, host="127.0.0.1", port=0, poll_interval=30) as router:
            client = ("--url", router.url, "--key-file", str(key), "--json")
            validate("router-fence", cli_doc("router", "fence", "w1", *client))
            validate("router-show", cli_doc("router", "show", *client))
            validate("router-fence", cli_doc("router", "unfence", "w1", *client))
            validate("error", cli_doc("router", "fence", "w9", *client, code=1))
