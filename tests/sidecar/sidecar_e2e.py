"""Helpers for the sidecar end-to-end tests (imported as ``sidecar_e2e``).

The sidecar runs as the operator runs it: the venv's ``gateway-capacity``
console script in its own process, stderr to a file the test reads. Final
assertions go through the ``availability``/``inspect`` CLI JSON; polling loops
use :func:`provider_now`, which builds the very same document in-process
(``availability_doc`` is what the CLI prints), because one CLI run costs
~0.4 s of interpreter start-up.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from capacity_server import CapacityServer
from gwtest import Agent, stopped_at_exit

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


def run_sidecar(config: Path, segment: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run a sidecar that is to exit at once (a refused start): its exit code and output."""
    argv = [EXE, "sidecar", "--config", str(config), "--segment", segment, *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=clean_env())


# --- the fixtures (tests/sidecar/conftest.py and tests/verify/conftest.py take them) ---------
Entry = Callable[..., dict[str, Any]]
StartSidecar = Callable[..., SidecarProc]
STATIC = {"id": "static", "maxConcurrent": 3}  # a provider beside p1 that never probes


@pytest.fixture
def servers(key: str) -> Iterator[Callable[..., CapacityServer]]:
    """Start contract servers on 127.0.0.1:0 (stopped afterwards); keyword args go to ``set``."""
    with stopped_at_exit(CapacityServer.stop) as keep:

        def start(server_key: str | None = None, **settings: Any) -> CapacityServer:
            server = keep(CapacityServer(server_key or key).start())
            server.set(**settings)
            return server

        yield start


@pytest.fixture
def capacity(servers: Callable[..., CapacityServer]) -> CapacityServer:
    """One router answering ``workhorse: 20`` (complete, fresh)."""
    return servers()


@pytest.fixture
def entry(key_file: Path) -> Entry:
    """A provider entry opted in to discovery against ``server`` (models: workhorse)."""

    def make(
        server: CapacityServer | str, provider_id: str = "p1", **fields: Any
    ) -> dict[str, Any]:
        base_url = server if isinstance(server, str) else server.base_url
        doc: dict[str, Any] = {
            "id": provider_id,
            "type": "chat-completions-api",
            "baseUrl": base_url,
            "credentialFile": str(key_file),
            "capacityDiscovery": True,
            "models": {"local-workhorse": "workhorse"},
        }
        doc.update(fields)
        return doc

    return make


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[StartSidecar]:
    """Start ``gateway-capacity sidecar`` processes; every one is killed afterwards."""
    numbers = itertools.count()
    with stopped_at_exit(SidecarProc.kill) as keep:

        def start(config: Path, segment: str, *extra: str, **kwargs: Any) -> SidecarProc:
            log_path = tmp_path / f"sidecar-{next(numbers)}.log"
            return keep(SidecarProc(config, segment, log_path, *extra, **kwargs))

        yield start


@pytest.fixture
def legacy() -> Iterator[subprocess.Popen[bytes]]:
    """The old handler generation (``--await-legacy``): a real process that runs until the
    test ends it."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET (short path: sun_path)."""
    directory = tempfile.mkdtemp(prefix="gwsd-", dir="/tmp")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        path = os.path.join(directory, "notify")
        sock.bind(path)
        yield path, sock
    finally:
        sock.close()
        shutil.rmtree(directory)


@dataclass
class Rig:
    """One end-to-end set-up: a fresh segment, the router ``capacity`` (``workhorse: 20``)
    and what writes configs and starts sidecars and handlers on that segment.

    A test reads as what it does: ``config = rig.config()`` (p1 opted in against
    ``capacity``, gateway maxConcurrent 8), ``sidecar = rig.start_discovered(config)``
    (a sidecar that has published p1's discovered 20), ``rig.handler("hold")``.
    """

    segment: str
    key: str
    capacity: CapacityServer
    servers: Callable[..., CapacityServer]
    entry: Entry
    write_config: Callable[..., Path]
    start_sidecar: StartSidecar
    agents: Callable[..., Agent]

    def config(
        self, *others: dict[str, Any], max_concurrent: int = 8, name: str = "gateway.json"
    ) -> Path:
        """A gateway config: p1 opted in to discovery against ``capacity``, then ``others``."""
        providers = [self.entry(self.capacity), *others]
        return self.write_config({"maxConcurrent": max_concurrent, "providers": providers}, name)

    def start(self, config: Path, *extra: str, **kwargs: Any) -> SidecarProc:
        """A sidecar on ``config`` and this segment (``extra``: more options)."""
        return self.start_sidecar(config, self.segment, *extra, **kwargs)

    def start_discovered(self, config: Path, *extra: str, **kwargs: Any) -> SidecarProc:
        """:meth:`start`, once the sidecar has published p1's discovered 20."""
        sidecar = self.start(config, *extra, **kwargs)
        self.wait("p1", discovered(20))
        return sidecar

    def wait(
        self,
        provider: str,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float = 10.0,
        what: str = "condition",
    ) -> dict[str, Any]:
        """:func:`wait_provider` on this segment."""
        return wait_provider(self.segment, provider, predicate, timeout, what)

    def handler(self, *args: str, provider: str = "p1") -> Agent:
        """A handler process (tests/agent.py) on this segment: ``handler("hold")``."""
        return self.agents("--segment", self.segment, "--provider", provider, *args)

    def provider(self, provider: str = "p1") -> dict[str, Any]:
        """The provider's entry of ``availability --json``, by the CLI."""
        return cli_provider(self.segment, provider)

    def sidecar_doc(self) -> dict[str, Any]:
        """``availability --json``'s sidecar, by the CLI (there must be one)."""
        doc = cli_json("availability", "--segment", self.segment)
        assert doc["sidecar"] is not None
        return dict(doc["sidecar"])


@pytest.fixture
def rig(
    segment_name: str,
    key: str,
    capacity: CapacityServer,
    servers: Callable[..., CapacityServer],
    entry: Entry,
    write_config: Callable[..., Path],
    start_sidecar: StartSidecar,
    agents: Callable[..., Agent],
) -> Rig:
    """:class:`Rig`: segment, router, config writer, sidecars and handlers in one."""
    return Rig(segment_name, key, capacity, servers, entry, write_config, start_sidecar, agents)
