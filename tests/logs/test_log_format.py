"""Log lines of the sidecar and the router: RFC 3339 timestamps, ``--log-format json|text``.

Real processes, as an operator runs them; a refused opt-in is a WARNING.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "router"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sidecar"))

from router_support import serve_args, worker, write_registry
from sidecar_e2e import SidecarProc, wait_doc

from capacity_router import SimWorker

# 2026-12-01T02:03:04.123Z: RFC 3339, UTC, milliseconds
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) ")


def _recent(stamp: str) -> bool:
    when = datetime.fromisoformat(stamp)
    return when.tzinfo is not None and abs(datetime.now(UTC) - when) < timedelta(minutes=5)


@pytest.fixture
def refused_config(write_config: Callable[..., Path], key_file: Path) -> Path:
    """One static provider and one that asks for discovery on a host it may not probe."""
    return write_config(
        {
            "maxConcurrent": 5,
            "providers": [
                {"id": "static", "maxConcurrent": 3},
                {
                    "id": "remote",
                    "baseUrl": "http://inference.example/v1",  # not loopback, no tailnet
                    "credentialFile": str(key_file),
                    "capacityDiscovery": True,
                    "models": {"a": "workhorse"},
                },
            ],
        }
    )


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[list[SidecarProc]]:
    started: list[SidecarProc] = []
    yield started
    for proc in started:
        proc.kill()


def _run_sidecar(
    started: list[SidecarProc], config: Path, segment: str, tmp_path: Path, *extra: str
) -> SidecarProc:
    proc = SidecarProc(config, segment, tmp_path / f"sidecar-{len(started)}.log", *extra)
    started.append(proc)
    wait_doc(segment, lambda d: d["sidecar"] is not None and len(d["providers"]) == 2)
    proc.signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    return proc


def test_json_logs_have_rfc3339_utc_timestamps_and_a_refused_opt_in_is_a_warning(
    refused_config: Path,
    segment_name: str,
    tmp_path: Path,
    key: str,
    sidecars: list[SidecarProc],
) -> None:
    proc = _run_sidecar(sidecars, refused_config, segment_name, tmp_path, "--log-format", "json")
    records = [json.loads(line) for line in proc.log_lines()]  # one object a line
    assert len(records) >= 3, records
    for record in records:
        assert {"ts", "level", "logger", "msg"} <= record.keys(), record
        assert STAMP.match(record["ts"] + " ") and _recent(record["ts"]), record["ts"]
        assert record["level"] in ("debug", "info", "warning", "error")
    refused = [r for r in records if r.get("provider") == "remote"]
    assert refused and refused[0]["level"] == "warning", refused
    assert "discovery refused" in refused[0]["msg"] and refused[0]["source"] == "gateway"
    static = [r for r in records if r.get("provider") == "static"]
    assert static and static[0]["level"] == "info", (
        static
    )  # static by choice is news, not a warning
    assert key not in proc.log_text()


def test_text_logs_start_with_an_rfc3339_timestamp_and_the_level(
    refused_config: Path, segment_name: str, tmp_path: Path, sidecars: list[SidecarProc]
) -> None:
    proc = _run_sidecar(sidecars, refused_config, segment_name, tmp_path)
    lines = proc.log_lines()
    assert len(lines) >= 3, lines
    for line in lines:
        m = STAMP.match(line)
        assert m and _recent(m.group(1)), line
        assert line[m.end() :].split(" ", 1)[0] in ("DEBUG", "INFO", "WARNING", "ERROR"), line
    assert any(
        "WARNING provider remote:" in line and "discovery refused" in line for line in lines
    ), lines


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_router_serve_takes_log_format_and_timestamps_its_lines(
    fmt: str, tmp_path: Path, key_file: Path
) -> None:
    sim = SimWorker(slots=4)
    sim.start()
    registry = tmp_path / "workers.json"
    write_registry(registry, [worker("w1", [sim.url], ["workhorse"])])
    argv = [sys.executable, "-m", "gateway_capacity", "router", *serve_args(registry, key_file)]
    proc = subprocess.Popen(
        [*argv, "--poll", "0.2", "--log-format", fmt],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line
        time.sleep(0.5)  # a few polls: the worker's state is logged once
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=20)
        sim.stop()
    assert proc.returncode == 0, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines, "the router logged nothing"
    for line in lines:
        if fmt == "json":
            record = json.loads(line)
            assert _recent(record["ts"]) and STAMP.match(record["ts"] + " "), record
            assert record["level"] in ("info", "warning", "error")
        else:
            m = STAMP.match(line)
            assert m and _recent(m.group(1)), line
            assert " router: " in line, line
    assert any("worker w1" in line for line in lines), lines


def test_a_text_line_escapes_control_characters_and_a_json_line_keeps_them() -> None:
    """What a worker or a router said can forge no log line and move no cursor."""
    import logging

    from gateway_capacity.logs import JsonFormatter, TextFormatter

    said = "x\n2026-12-04T00:00:00.000Z WARNING forged\x1b[2J\u202e \\n"
    record = logging.LogRecord("router", logging.INFO, __file__, 1, "worker: %s", (said,), None)
    line = TextFormatter("router: ").format(record)
    assert line.endswith(
        "INFO router: worker: x\\n2026-12-04T00:00:00.000Z WARNING forged\\x1b[2J\\u202e \\\\n"
    )
    assert line.isprintable()
    assert json.loads(JsonFormatter().format(record))["msg"] == f"worker: {said}"
