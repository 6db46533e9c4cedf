"""Helpers for the sidecar end-to-end tests (imported as ``sidecar_e2e``).

The sidecar runs as the operator runs it: the venv's ``gateway-capacity``
console script in its own process, stderr to a file the test reads. Final
assertions go through the ``availability``/``inspect`` CLI JSON; polling loops
use :func:`provider_now`, which builds the very same document in-process
(``availability_doc`` is what the CLI prints), because one CLI run costs
~0.4 s of interpreter start-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXE = str(Path(sys.executable).with_name("gateway-capacity"))

# Variables from the test's own environment that would change what a sidecar does.
_SCRUBBED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "GATEWAY_CAPACITY_SEGMENT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env.update(extra)
    return env


class SidecarProc:
    """One ``gateway-capacity sidecar`` process."""

    def __init__(
        self,
        config: Path,
        segment: str,
        log_path: Path,
        *extra: str,
        refresh: float = 0.3,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = [
            EXE,
            "sidecar",
            "--config",
            str(config),
            "--segment",
            segment,
            "--refresh",
            str(refresh),
            *extra,
        ]
        self.log_path = log_path
        with open(log_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env if env is not None else clean_env(),
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_lines(self) -> list[str]:
        return [line for line in self.log_text().splitlines() if line.strip()]


def provider_now(segment: str, provider: str) -> dict[str, Any] | None:
    """The provider's entry of ``availability --json``, built in-process; None if absent."""
    from gateway_capacity.cmd_views import availability_doc
    from shm_layout.segment import SegmentError
    from shm_layout.view import read_view

    try:
        doc = availability_doc(read_view(segment))
    except SegmentError:
        return None
    for p in doc["providers"]:
        if p["id"] == provider:
            return dict(p)
    return None


def doc_now(segment: str) -> dict[str, Any] | None:
    from gateway_capacity.cmd_views import availability_doc
    from shm_layout.segment import SegmentError
    from shm_layout.view import read_view

    try:
        return availability_doc(read_view(segment))
    except SegmentError:
        return None


def wait_provider(
    segment: str,
    provider: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout: float = 10.0,
    what: str = "condition",
) -> dict[str, Any]:
    """Poll until ``predicate(entry)``; fail with the last entry seen."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while True:
        last = provider_now(segment, provider)
        if last is not None and predicate(last):
            return last
        if time.monotonic() > deadline:
            shown = json.dumps(last, indent=1)
            raise AssertionError(f"{provider}: {what} not reached within {timeout}s; last: {shown}")
        time.sleep(0.05)


def wait_doc(
    segment: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        last = doc_now(segment)
        if last is not None and predicate(last):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout}s; last: {json.dumps(last)}")
        time.sleep(0.05)


def discovered(limit: int) -> Callable[[dict[str, Any]], bool]:
    return lambda p: p["source"] == "discovered" and p["effective_limit"] == limit


def cli_json(*args: str) -> dict[str, Any]:
    out = subprocess.run([EXE, *args, "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def cli_providers(segment: str) -> dict[str, dict[str, Any]]:
    """``availability --segment S --json`` by the CLI: provider id -> entry."""
    return {p["id"]: p for p in cli_json("availability", "--segment", segment)["providers"]}


def cli_provider(segment: str, provider: str) -> dict[str, Any]:
    for p in cli_json("availability", "--segment", segment)["providers"]:
        if p["id"] == provider:
            return dict(p)
    raise AssertionError(f"no provider {provider} in availability")


# The fixtures' types (tests/sidecar/conftest.py), one home for every test module.
Entry = Callable[..., dict[str, Any]]
StartSidecar = Callable[..., SidecarProc]
