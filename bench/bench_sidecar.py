"""The sidecar's footprint: RSS and CPU while it polls one loopback provider every second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
from bench_common import Cleanup, new_segment_name

MODEL = "bench-upstream"
SLOTS = 6


@dataclass
class SidecarResult:
    seconds: float
    rss_mib: float
    peak_rss_mib: float
    cpu_percent: float  # of one core
    probes: int  # capacity requests the sidecar made during the window
    published: int | None  # the limit it published, read back from the segment


def sidecar_command() -> list[str]:
    return [sys.executable, "-m", "gateway_capacity", "sidecar"]


def sidecar_available() -> bool:
    try:
        done = subprocess.run(
            [*sidecar_command(), "--help"], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


class _Capacity(BaseHTTPRequestHandler):
    key = ""
    probes = 0

    def do_GET(self) -> None:
        if self.path != "/v1/capacity":
            self.send_error(404)
            return
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_error(401)
            return
        type(self).probes += 1
        body = json.dumps(
            {
                "object": "inference_capacity",
                "version": 1,
                "complete": True,
                "observed_at": time.time(),
                "models": [{"id": MODEL, "max_concurrent_requests": SLOTS}],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def run_sidecar(cleanup: Cleanup, seconds: float, warmup: float = 2.0) -> SidecarResult:
    from shm_layout import read_view

    with cleanup.scope() as scope:
        directory = scope.tempdir()
        key = os.urandom(16).hex()
        handler: type[_Capacity] = type("Capacity", (_Capacity,), {"key": key, "probes": 0})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        scope.push("capacity server", server.server_close)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        scope.push("capacity server thread", server.shutdown)
        port = server.server_address[1]

        key_file = os.path.join(directory, "provider.key")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        config = os.path.join(directory, "gateway.json")
        with open(config, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "maxConcurrent": 4,
                    "providers": [
                        {
                            "id": "bench",
                            "type": "chat-completions-api",
                            "baseUrl": f"http://127.0.0.1:{port}/v1",
                            "credentialFile": key_file,
                            "capacityDiscovery": True,
                            "maxConcurrent": 12,
                            "models": {"bench": MODEL},
                        }
                    ],
                },
                f,
            )
        segment = scope.segment(new_segment_name())
        env = dict(os.environ, GATEWAY_CAPACITY_SEGMENT=segment)
        log_path = os.path.join(directory, "sidecar.log")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [*sidecar_command(), "--config", config, "--segment", segment, "--refresh", "1"],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        scope.popen(proc)
        watched = psutil.Process(proc.pid)
        time.sleep(warmup)
        _check_alive(proc, log_path)
        probes0 = handler.probes
        t0 = time.monotonic()
        c0 = watched.cpu_times()
        rss: list[int] = []
        while time.monotonic() - t0 < seconds:
            rss.append(watched.memory_info().rss)
            time.sleep(0.25)
        c1 = watched.cpu_times()
        wall = time.monotonic() - t0
        _check_alive(proc, log_path)
        probes = handler.probes - probes0
        published = None
        try:
            provider = read_view(segment).provider("bench")
            published = provider.effective_limit if provider is not None else None
        except Exception:
            published = None
        cpu = (c1.user + c1.system) - (c0.user + c0.system)
        return SidecarResult(
            seconds=wall,
            rss_mib=rss[-1] / 2**20,
            peak_rss_mib=max(rss) / 2**20,
            cpu_percent=100.0 * cpu / wall,
            probes=probes,
            published=published,
        )


def _check_alive(proc: subprocess.Popen[bytes], log_path: str) -> None:
    if proc.poll() is not None:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-600:]
        raise RuntimeError(f"sidecar exited with {proc.returncode}:\n{tail}")
