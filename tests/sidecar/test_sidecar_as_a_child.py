"""The sidecar as a child of the gateway's supervisor (``--parent-pid``; docs/macos.md).

On a Mac there is no systemd unit: the gateway's supervisor starts the sidecar as its
child and passes its own pid. Here a real supervisor process does exactly that and is
then SIGKILLed, as a crash would end it: the sidecar, handed to another parent by the
kernel, notices (``getppid()`` changed), stops cleanly and says why. It runs on Linux,
in the darwin test mode (`make test`) and on a Mac (`make mac-check`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
from gwtest import run_cli, wait_for

SUPERVISOR = """
import os, subprocess, sys, time
log = open(sys.argv[1], "w")
child = subprocess.Popen(
    [sys.argv[2], "sidecar", "--config", sys.argv[3], "--segment", sys.argv[4],
     "--refresh", "1", "--parent-pid", str(os.getpid())],
    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
)
print(child.pid, flush=True)
time.sleep(120)
"""


def _sidecar_alive(segment: str) -> bool | None:
    out = run_cli("availability", "--segment", segment, "--json")
    if out.returncode != 0:
        return None  # not created yet
    sidecar = json.loads(out.stdout)["sidecar"]
    return None if sidecar is None else bool(sidecar["alive"])


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def test_parent_pid_a_sidecar_whose_supervisor_is_killed_stops_cleanly(
    segment_name: str, write_config: Callable[..., Path], tmp_path: Path
) -> None:
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 3}]})
    exe = Path(sys.executable).with_name("gateway-capacity")
    log = tmp_path / "sidecar.log"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(log), str(exe), str(config), segment_name],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert supervisor.stdout is not None
    sidecar = int(supervisor.stdout.readline())
    try:

        def publishing() -> bool:
            return _sidecar_alive(segment_name) is True

        wait_for(publishing, timeout=30)
        assert not _gone(sidecar)
        supervisor.send_signal(signal.SIGKILL)  # the gateway crashed
        supervisor.wait()
        wait_for(lambda: _gone(sidecar), timeout=10)
    finally:
        supervisor.kill()
        supervisor.wait()
        if not _gone(sidecar):
            psutil.Process(sidecar).kill()
    assert f"parent process {supervisor.pid} exited: stopping" in log.read_text()
    assert _sidecar_alive(segment_name) is False  # it stopped as a stopped sidecar does
