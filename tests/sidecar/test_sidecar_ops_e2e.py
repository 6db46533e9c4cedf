"""What an operator runs around the sidecar: metrics, JSON logs, systemd readiness (R-P7)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
from sidecar_e2e import EXE, STATIC, Rig, clean_env, discovered, doc_now


def _scrape(url: str) -> str | None:
    try:
        resp = httpx.get(url, timeout=2.0, trust_env=False)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


@pytest.mark.parametrize("listen", ["busy", "127.0.0.1:notaport", "127.0.0.1"])
def test_r_g4_an_unusable_metrics_address_exits_2_without_fencing_the_running_sidecar(
    listen: str, rig: Rig
) -> None:
    config = rig.config()
    running = rig.start_discovered(config)
    epoch = rig.sidecar_doc()["writer_epoch"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        if listen == "busy":
            listen = f"127.0.0.1:{busy.getsockname()[1]}"
        failed = rig.start(config, "--metrics-listen", listen)
        assert failed.wait(30) == 2
    lines = failed.log_lines()
    assert len(lines) == 1 and "--metrics-listen" in lines[0], lines
    assert "Traceback" not in failed.log_text()
    sidecar = rig.sidecar_doc()
    assert (sidecar["pid"], sidecar["writer_epoch"]) == (running.pid, epoch)
    assert running.poll() is None


def test_r_p7_json_logs_are_one_object_a_line_and_the_key_appears_nowhere(rig: Rig) -> None:
    capacity, key = rig.capacity, rig.key
    config = rig.config()
    sidecar = rig.start_discovered(config, "--log-format", "json", "--log-level", "DEBUG")
    # events worth a log line: a rejected key, a router echoing the key, a config edit
    capacity.set(key="sk-rotated-on-the-router-only")
    rig.wait("p1", lambda p: p["source"] == "gateway", what="auth_failed")
    capacity.set(key=key, models={key: 5, "workhorse": 7})
    rig.wait("p1", discovered(7))
    assert rig.config(max_concurrent=6) == config  # the same file, rewritten
    rig.wait("p1", lambda p: p["fallback_limit"] == 6, what="config edit")

    outputs = {
        name: subprocess.run(
            [EXE, *args, "--segment", rig.segment], capture_output=True, text=True, timeout=30
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
    shm = Path("/dev/shm") / rig.segment.lstrip("/")
    if shm.exists():  # Linux: the segment itself
        assert key.encode() not in shm.read_bytes()
    assert key not in " ".join(sidecar.argv)


def test_systemd_ready_after_the_first_publication_then_watchdog_and_stopping(
    notify_socket: tuple[str, socket.socket], rig: Rig
) -> None:
    path, sock = notify_socket
    env = clean_env(NOTIFY_SOCKET=path, WATCHDOG_USEC="1000000")
    sidecar = rig.start(rig.config(STATIC), env=env)
    sock.settimeout(15)
    assert sock.recv(4096) == b"READY=1"  # first: nothing before readiness

    def recv_skipping_status() -> bytes:  # STATUS= lines follow each change of a limit
        while (message := sock.recv(4096)).startswith(b"STATUS="):
            pass
        return message

    # ready means published: the segment holds this sidecar and every configured provider
    doc = doc_now(rig.segment)
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
