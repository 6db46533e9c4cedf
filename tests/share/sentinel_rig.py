"""A Sentinel set on loopback for share mode's failover tests: one master, one replica
and three sentinels, each a real ``redis-server`` (the sentinels run with
``--sentinel``), nothing saved to disk."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gwtest
from redis_rig import RedisServer, _free_port

MASTER_NAME = "gwcap"
DOWN_AFTER_MS = 1000  # a master silent this long is down for a sentinel
FAILOVER_TIMEOUT_MS = 3000


class SentinelSet:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.master = RedisServer(workdir / "m")
        self.replica = RedisServer(workdir / "r")
        self.sentinel_ports = [_free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes] | None] = [None, None, None]
        for sub in ("m", "r", "s0", "s1", "s2"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.sentinel_ports]

    def start(self) -> None:
        """Master, replica (replicating it) and three sentinels watching it: all empty,
        the master the one first started."""
        self.master.start()
        self.replica.extra = ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start()
        for i, port in enumerate(self.sentinel_ports):
            conf = self.workdir / f"s{i}" / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {conf.parent}\n"
                f"logfile {conf.parent / 'sentinel.log'}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self.sentinels[i] = subprocess.Popen(
                [self.master.exe, str(conf), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait(lambda: self.master_port() == self.master.port, "the sentinels see the master")
        self.wait(self._replica_synced, "the replica in sync")

    def _replica_synced(self) -> bool:
        with contextlib.suppress(Exception):
            info = self.replica.client().info("replication")
            return bool(info.get("master_link_status") == "up")
        return False

    def sentinel_client(self, i: int = 0) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.sentinel_ports[i], socket_timeout=2)

    def master_port(self) -> int | None:
        """The master's port as a majority of the sentinels that answer name it."""
        seen: list[int] = []
        for i in range(3):
            with contextlib.suppress(Exception):
                _host, port = self.sentinel_client(i).sentinel_get_master_addr_by_name(MASTER_NAME)
                seen.append(int(port))
        for port in seen:
            if seen.count(port) >= 2:
                return port
        return None

    def wait(self, predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
        gwtest.wait_for(predicate, timeout, every=0.05, what=what)

    def processes(self) -> list[subprocess.Popen[bytes]]:
        found = [s for s in (self.master.proc, self.replica.proc, *self.sentinels) if s]
        return [p for p in found if p.poll() is None]

    def signal_all(self, sig: signal.Signals) -> None:
        for proc in self.processes():
            os.kill(proc.pid, sig)

    def stop(self) -> None:
        """Every process SIGKILLed (a stopped one woken first)."""
        for proc in self.processes():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        self.master.proc = self.replica.proc = None
        self.sentinels = [None, None, None]
