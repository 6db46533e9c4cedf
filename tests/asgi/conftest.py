"""Real ASGI servers (uvicorn, gunicorn with uvicorn workers) for the middleware tests,
started as tests/served.py starts servers (a socket bound here, passed by number)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # asgi_support

import served
from asgi_support import APP_DIR, Server, StartServer, attached_members
from gwtest import wait_until
from served import gunicorn_argv, listening_socket, uvicorn_argv


@pytest.fixture
def asgi_config(tmp_path: Path) -> Path:
    """p1 with a static limit of 2 (no sidecar needed: the first worker creates the segment)."""
    path = tmp_path / "gateway.json"
    path.write_text(
        json.dumps({"maxConcurrent": 4, "providers": [{"id": "p1", "maxConcurrent": 2}]})
    )
    return path


@pytest.fixture
def start_server(tmp_path: Path, segment_name: str, asgi_config: Path) -> Iterator[StartServer]:
    servers: list[Server] = []

    def start(
        kind: str = "uvicorn",
        *,
        workers: int = 1,
        preload: bool = False,
        lifespan: str = "auto",
        timeout: float = 30.0,
        generation: str = "gen-A",
        config: Path | None = asgi_config,
        wait_attached: bool = True,
        by_model: bool | str = False,
        env_extra: dict[str, str] | None = None,
    ) -> Server:
        release_dir = tmp_path / f"release-{len(servers)}"
        release_dir.mkdir()
        log = tmp_path / f"server-{len(servers)}.log"
        sock = listening_socket()
        env = {
            **os.environ,
            "GWT_CONFIG": str(config) if config is not None else "",
            "GWT_SEGMENT": segment_name,
            "GWT_TIMEOUT": str(timeout),
            "GWT_RELEASE_DIR": str(release_dir),
            "PYTHONUNBUFFERED": "1",
            "GWT_BY_MODEL": by_model if isinstance(by_model, str) else "1" if by_model else "0",
            **(env_extra or {}),
        }
        pidfile = None
        if kind == "uvicorn":
            env["GWT_GENERATION"] = generation
            args = uvicorn_argv(
                "asgi_app:app", APP_DIR, sock, "--lifespan", lifespan, "--no-access-log"
            )
        else:
            pidfile = tmp_path / f"gunicorn-{len(servers)}.pid"
            conf = tmp_path / f"gunicorn-{len(servers)}.conf.py"
            conf.write_text(f"raw_env = [{f'GWT_GENERATION={generation}'!r}]\n")
            args = gunicorn_argv(
                "asgi_app:app",
                APP_DIR,
                sock,
                *("--pid", str(pidfile), "-c", str(conf), "--graceful-timeout", "10"),
                *(["--preload"] if preload else []),
                workers=workers,
            )
        proc = served.start(args, sock, log, env, cwd=tmp_path)
        port = sock.getsockname()[1]
        sock.close()
        server = Server(proc, port, segment_name, release_dir, log, pidfile)
        servers.append(server)
        if wait_attached:
            expected = workers
            ok = wait_until(
                lambda: attached_members(segment_name, generation) >= expected, timeout=30
            )
            assert ok, f"{kind} did not attach {expected} worker(s):\n{server.output()}"
        return server

    yield start
    for server in servers:
        server.release()
        with contextlib.suppress(subprocess.TimeoutExpired):  # stop() has killed it then
            server.stop()


@pytest.fixture
def uvicorn(start_server: StartServer) -> Server:
    """tests/asgi/asgi_app.py under uvicorn, one worker, p1 at 2, attached (generation gen-A)."""
    return start_server("uvicorn")
