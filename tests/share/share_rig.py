"""Three gateways on one machine in front of one fake farm: a sidecar and a segment
each, real handler processes (load_worker.py), one redis-server."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gwtest
from farm import Farm
from redis_rig import RedisServer

EXE = str(Path(sys.executable).with_name("gateway-capacity"))
WORKER = str(Path(__file__).with_name("load_worker.py"))
LEASE = 2.0
REFRESH = 0.3


class Gateway:
    def __init__(
        self,
        name: str,
        tmp: Path,
        farm: Farm,
        redis: RedisServer,
        key_file: Path,
        redis_url: str | None = None,
        **share: Any,
    ):
        self.name = name
        self.tmp = tmp
        self.farm = farm
        self.segment = "/gwt-share-" + secrets.token_hex(5)
        self.config = tmp / f"{name}.json"
        doc = {
            "maxConcurrent": 4,
            "capacityShare": {
                "redis": redis_url or redis.url,
                "gateway": name,
                "lease": LEASE,
                "floor": 1,
                **share,
            },
            "providers": [
                {
                    "id": "p1",
                    "baseUrl": farm.base_url,
                    "credentialFile": str(key_file),
                    "capacityDiscovery": True,
                    "models": {"w": "workhorse"},
                }
            ],
        }
        self.config.write_text(json.dumps(doc))
        self.sidecar: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[str]] = []
        self.done = 0
        self.log = tmp / f"{name}-sidecar.log"

    def start_sidecar(
        self, *extra: str, prefix: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> None:
        """Start the sidecar (``prefix``: a wrapper such as faketime; ``env``: added)."""
        self.sidecar = gwtest.start_sidecar(
            self.config,
            self.segment,
            self.log,
            *extra,
            refresh=REFRESH,
            prefix=prefix,
            env=gwtest.scrubbed_env(**(env or {})),
        )

    def kill_sidecar(self) -> None:
        if self.sidecar is not None and self.sidecar.poll() is None:
            self.sidecar.kill()
            self.sidecar.wait(10)
        if self.sidecar is not None:  # one started with libfaketime preloaded leaves its state
            gwtest.remove_faketime_state(self.sidecar.pid)

    def start_worker(self, threads: int, hold_ms: float = 40.0) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [
                sys.executable,
                WORKER,
                "--segment",
                self.segment,
                "--farm",
                self.farm.base_url,
                "--threads",
                str(threads),
                "--hold-ms",
                str(hold_ms),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=gwtest.scrubbed_env(),
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        self.workers.append(proc)
        return proc

    def stop_workers(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("exit\n")
                proc.stdin.flush()
                out = proc.stdout.read()
                proc.wait(30)
                for line in out.splitlines():
                    if line.startswith("done "):
                        self.done += int(line.split()[1])
        self.workers = []

    def kill_all(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.workers = []
        self.kill_sidecar()

    def provider(self) -> dict[str, Any] | None:
        from gateway_capacity.cmd_views import availability_doc
        from shm_layout.segment import SegmentError
        from shm_layout.view import read_view

        try:
            doc = availability_doc(read_view(self.segment))
        except SegmentError:
            return None
        for p in doc["providers"]:
            if p["id"] == "p1":
                return dict(p)
        return None

    def source(self) -> str:
        p = self.provider()
        return "" if p is None else str(p["source"])

    def limit(self) -> int:
        p = self.provider()
        return -1 if p is None else int(p["effective_limit"])

    def check(self) -> subprocess.CompletedProcess[str]:
        return self._cli("availability", "--check", timeout=30)

    def verify(self) -> subprocess.CompletedProcess[str]:
        return self._cli("verify", "--json", timeout=60)

    def _cli(self, *argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """``gateway-capacity ARGV --segment`` this gateway's segment."""
        return subprocess.run(
            [EXE, *argv, "--segment", self.segment],
            capture_output=True,
            text=True,
            env=gwtest.scrubbed_env(),
            timeout=timeout,
        )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def cleanup(self) -> None:
        self.kill_all()
        from shm_layout.segment import unlink_segment

        unlink_segment(self.segment)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    gwtest.wait_for(predicate, timeout, every=0.05, what=what)


def sigstop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


class Blackhole:
    """A TCP relay on 127.0.0.1 in front of ``port`` that can be cut: while cut, it
    forwards nothing either way and answers nothing (a partition, as a client sees one:
    its calls time out), and new connections wait unanswered."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.open = threading.Event()
        self.open.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut(self) -> None:
        self.open.clear()

    def heal(self) -> None:
        self.open.set()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.open.wait()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self.open.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for end in (src, dst):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop = True
        self.open.set()
        self._listener.close()
