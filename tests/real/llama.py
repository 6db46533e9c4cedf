"""Real llama.cpp llama-server processes for tests and recordings, on loopback.

The binary comes from scripts/build-llama-server (``make real-workers`` builds it once
into a cache and sets ``GWCAP_LLAMA_SERVER``); the model is the tiny random-weight llama
that scripts/tiny_gguf.py writes. Nothing here downloads anything.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SERVER_ENV = "GWCAP_LLAMA_SERVER"


def binary() -> Path | None:
    """The llama-server to use, or None (tests skip with the reason)."""
    path = os.environ.get(LLAMA_SERVER_ENV)
    return Path(path) if path and Path(path).is_file() else None


def tiny_model(directory: Path, name: str = "tiny-llama") -> Path:
    """Write the tiny model (a few MB, under a second) into directory; return its path."""
    server = binary()
    assert server is not None
    vocab = server.parent.parent / "models" / "ggml-vocab-llama-spm.gguf"
    out = directory / f"{name}.gguf"
    if not out.exists():
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "tiny_gguf.py"),
                str(vocab),
                str(out),
                "--name",
                name,
            ],
            check=True,
        )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One llama-server on 127.0.0.1; ``args`` are its own flags."""

    def __init__(self, args: list[str], log: Path, key: str | None = None, port: int = 0) -> None:
        server = binary()
        assert server is not None
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [str(server), "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited {self.proc.returncode}; see {self._log.name}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"llama-server on {self.url} not healthy within {timeout} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@contextmanager
def llama_server(args: list[str], log: Path, key: str | None = None) -> Iterator[LlamaServer]:
    server = LlamaServer(args, log, key)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
