"""A private redis-server on loopback and the Lua semaphore a user would share a budget with."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from typing import Any

from bench_common import Cleanup, stop_popen

# What a user would write to share a budget through Redis: admit while below the
# limit, atomically; release is a plain DECR.
ACQUIRE_LUA = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n < tonumber(ARGV[1]) then
  redis.call('INCR', KEYS[1])
  return 1
end
return 0
"""


class RedisUnavailable(Exception):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_redis(cleanup: Cleanup) -> Any:
    """Start ``redis-server`` on a free 127.0.0.1 port; returns a connected client.

    No persistence (``--save ''``, no AOF); stopped by ``cleanup``.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisUnavailable("redis-server not installed (make bench installs it via apt)")
    try:
        import redis
    except ImportError:
        raise RedisUnavailable("python package 'redis' missing (the bench extra)") from None
    workdir = cleanup.tempdir()
    logfile = os.path.join(workdir, "redis.log")
    last = ""
    for _attempt in range(5):  # the port may be taken between probing and binding
        port = _free_port()
        proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
                "--logfile",
                logfile,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches us, and we stop it in order
        )
        cleanup.popen(proc)
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    return client
            time.sleep(0.02)
        stop_popen(proc)
        with contextlib.suppress(OSError), open(logfile, encoding="utf-8", errors="replace") as f:
            last = f.read().strip()[-300:]
    raise RedisUnavailable(f"redis-server did not start: {last or 'no answer on loopback'}")


class RedisSemaphore:
    """The Lua counting semaphore: EVALSHA to acquire (below the limit), DECR to release."""

    def __init__(self, client: Any, key: str, limit: int) -> None:
        self._client = client
        self._key = key
        self._limit = limit
        self._acquire = client.register_script(ACQUIRE_LUA)
        client.delete(key)

    def try_acquire(self) -> bool:
        return bool(self._acquire(keys=[self._key], args=[self._limit]))

    def release(self) -> None:
        self._client.decr(self._key)
