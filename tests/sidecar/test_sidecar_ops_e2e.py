"""What an operator runs around the sidecar: metrics, JSON logs, systemd readiness (R-P7)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from capacity_server import CapacityServer
from sidecar_e2e import (
    EXE,
    Entry,
    StartSidecar,
    clean_env,
    cli_json,
    discovered,
    wait_provider,
)


def _scrape(url: str) -> str | None:
    try:
        resp = httpx.get(url, timeout=2.0, trust_env=False)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


@pytest.mark.parametrize("listen", ["busy", "127.0.0.1:notaport", "127.0.0.1"])
def test_r_g4_an_unusable_metrics_address_exits_2_without_fencing_the_running_sidecar(
    listen: str,
    segment_name: str,
    write_config: Callable[..., Path],
    capacity: CapacityServer,
    entry: Entry,
    start_sidecar: StartSidecar,
) -> None:
    config = write_config({"maxConcurrent": 8, "providers": [entry(capacity)]})
    running = start_sidecar(config, segment_name)
    wait_provider(segment_name, "p1", discovered(20))
    epoch = cli_json("availability", "--segment", segment_name)["sidecar"]["writer_epoch"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        if listen == "busy":
            listen = f"127.0.0.1:{busy.getsockname()[1]}"
        failed = start_sidecar(config, segment_name, "--metrics-listen", listen)
        assert failed.wait(30) == 2
    lines = failed.log_lines()
    assert len(lines) == 1 and "--metrics-listen" in lines[0], lines
    assert "Traceback" not in failed.log_text()
    sidecar = cli_json("availability", "--segment", segment_name)["sidecar"]
    assert (sidecar["pid"], sidecar["writer_epoch"]) == (running.pid, epoch)
    assert running.poll() is None


def test_r_p7_json_logs_are_one_object_a_line_and_the_key_appears_nowhere(
    segment_name: str,
    write_config: Callable[..., Path],
    capacity: CapacityServer,
    entry: Entry,
    key: str,
    start_sidecar: StartSidecar,
) -> None:
    config = write_config({"maxConcurrent": 8, "providers": [entry(capacity)]})
    sidecar = start_sidecar(config, segment_name, "--log-format", "json", "--log-level", "DEBUG")
    wait_provider(segment_name, "p1", discovered(20))
    # events worth a log line: a rejected key, a router echoing the key, a config edit
    capacity.set(key="sk-rotated-on-the-router-only")
    wait_provider(segment_name, "p1", lambda p: p["source"] == "gateway", what="auth_failed")
    capacity.set(key=key, models={key: 5, "workhorse": 7})
    wait_provider(segment_name, "p1", discovered(7))
    config.write_text(json.dumps({"maxConcurrent": 6, "providers": [entry(capacity)]}))
    wait_provider(segment_name, "p1", lambda p: p["fallback_limit"] == 6, what="config edit")

    outputs = {
        name: subprocess.run(
            [EXE, *args, "--segment", segment_name], capture_output=True, text=True, timeout=30
        )
        for name, args in {
            "availability": ["availability"],
            "availability --json": ["availability", "--json"],
            "inspect": ["inspect"],
            "inspect --json": ["inspect", "--json"],
        }.items()
    }
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(10) == 0

    lines = sidecar.log_lines()
    assert len(lines) >= 5, lines
    for line in lines:
        record = json.loads(line)  # every line is one JSON object
        assert {"ts", "level", "msg"} <= record.keys(), record
    assert any("auth_failed" in json.loads(line)["msg"] for line in lines)
    assert key not in sidecar.log_text()
    for name, out in outputs.items():
        assert out.returncode == 0, (name, out.stderr)
        assert key not in out.stdout + out.stderr, name
    shm = Path("/dev/shm") / segment_name.lstrip("/")
    if shm.exists():  # Linux: the segment itself
        assert key.encode() not in shm.read_bytes()
    assert key not in " ".join(sidecar.argv)


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET (short path: sun_path)."""
    directory = tempfile.mkdtemp(prefix="gwsd-", dir="/tmp")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = os.path.join(directory, "notify")
    sock.bind(path)
    try:
        yield path, sock
    finally:
        sock.close()
        shutil.rmtree(directory)


def test_systemd_ready_after_the_first_publication_then_watchdog_and_stopping(
    notify_socket: tuple[str, socket.socket],
    segment_name: str,
    write_config: Callable[..., Path],
    capacity: CapacityServer,
    entry: Entry,
    start_sidecar: StartSidecar,
) -> None:
    path, sock = notify_socket
    config = write_config(
        {"maxConcurrent": 8, "providers": [entry(capacity), {"id": "static", "maxConcurrent": 3}]}
    )
    env = clean_env(NOTIFY_SOCKET=path, WATCHDOG_USEC="1000000")
    sidecar = start_sidecar(config, segment_name, env=env)
    sock.settimeout(15)
    assert sock.recv(4096) == b"READY=1"  # first: nothing before readiness

    def recv_skipping_status() -> bytes:  # STATUS= lines follow each change of a limit
        while (message := sock.recv(4096)).startswith(b"STATUS="):
            pass
        return message

    # ready means published: the segment holds this sidecar and every configured provider
    from sidecar_e2e import doc_now

    doc = doc_now(segment_name)
    assert doc is not None and doc["sidecar"]["pid"] == sidecar.pid
    assert doc["sidecar"]["alive"] and doc["sidecar"]["state"] == "running"
    assert {p["id"] for p in doc["providers"] if p["configured"]} == {"p1", "static"}

    sock.settimeout(5)  # WatchdogSec=1: a ping every half second
    assert recv_skipping_status() == b"WATCHDOG=1"
    assert recv_skipping_status() == b"WATCHDOG=1"
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(10) == 0
    rest = []
    sock.setblocking(False)
    while True:
        try:
            rest.append(sock.recv(4096))
        except BlockingIOError:
            break
    rest = [m for m in rest if not m.startswith(b"STATUS=")]
    assert b"STOPPING=1" in rest and set(rest) <= {b"WATCHDOG=1", b"STOPPING=1"}, rest
