"""Real llama.cpp llama-server processes for tests and recordings, on loopback.

The binary comes from scripts/build-llama-server (``make real-workers`` builds it once
into a cache and sets ``GWCAP_LLAMA_SERVER``); the model is the tiny random-weight llama
that scripts/tiny_gguf.py writes. Nothing here downloads anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gwtest import free_port
from servers import RealServer

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


class LlamaServer(RealServer):
    """One llama-server on 127.0.0.1; ``args`` are its own flags."""

    def __init__(self, args: list[str], log: Path, key: str | None = None, port: int = 0) -> None:
        server = binary()
        assert server is not None
        port = port or free_port()
        argv = [str(server), "--host", "127.0.0.1", "--port", str(port), "--threads", "1", *args]
        super().__init__("llama-server", argv, log, port, dict(os.environ))
        self.key = key

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def wait_healthy(self, timeout: float = 60.0, every: float = 0.1) -> float:
        return super().wait_healthy(timeout, every)

    def stop(self, grace: float = 10.0) -> None:
        super().stop(grace)


@contextmanager
def llama_server(args: list[str], log: Path, key: str | None = None) -> Iterator[LlamaServer]:
    server = LlamaServer(args, log, key)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
