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
from capacity_farm import MODEL, capacity_body


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
        body = capacity_body()
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


# --- the sidecar as the work grows: providers x replicas at --refresh 1 ---------------------

HERE = os.path.dirname(os.path.abspath(__file__))
SCALES = ((1, 1), (8, 4), (32, 4), (64, 1), (64, 4))  # (providers, replicas)


@dataclass
class ScaleResult:
    providers: int
    replicas: int
    cpu_percent: float  # of one core, median of the rounds
    rss_mib: float  # peak, median of the rounds
    probes_per_s: float  # replica answers the farm gave per second, median
    expected_per_s: float  # providers x replicas / refresh: "on time" means this many

    @property
    def cpu_ms_per_probe(self) -> float:
        """All the sidecar's CPU (publishing, housekeeping too) per replica answer."""
        return 10.0 * self.cpu_percent / self.probes_per_s if self.probes_per_s else 0.0


def _source_env(source: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GWCAP_BENCH_SOURCE", None)
    if source:
        env["GWCAP_BENCH_SOURCE"] = os.path.abspath(source)
    return env


def _sidecar_argv(source: str | None) -> list[str]:
    if not source:
        return sidecar_command()
    return [sys.executable, os.path.join(HERE, "bench_source.py"), "sidecar"]


def start_farm(scope: object, key_file: str, addresses: int) -> tuple[int, object]:
    farm = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "capacity_farm.py"),
            "--addresses",
            str(addresses),
            "--key-file",
            key_file,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    scope.popen(farm)  # type: ignore[attr-defined]
    assert farm.stdout is not None
    port = int(farm.stdout.readline() or b"0")
    if not port:
        raise RuntimeError("the capacity farm did not start")
    return port, farm


def farm_answers(port: int) -> int:
    """How many capacity answers the farm gave; asked over a connection of its own (a
    starved farm on a loaded host may take a while: tried 3 times, 30 s each)."""
    import http.client

    for attempt in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/stats")
            return int(conn.getresponse().read())
        except OSError:
            if attempt == 2:
                raise
        finally:
            conn.close()
    raise AssertionError("unreachable")


def replicas_possible() -> bool:
    """More than one replica per host needs a hosts file of our own for the sidecar: a
    private mount namespace (root and unshare)."""
    import shutil

    return os.geteuid() == 0 and shutil.which("unshare") is not None


def run_scale_round(
    cleanup: Cleanup,
    providers: int,
    replicas: int,
    seconds: float,
    warmup: float = 3.0,
    source: str | None = None,
) -> tuple[float, float, float]:
    """One round: (CPU % of one core, peak RSS MiB, replica answers per second)."""
    with cleanup.scope() as scope:
        directory = scope.tempdir()
        key = os.urandom(16).hex()
        key_file = os.path.join(directory, "provider.key")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        port, _ = start_farm(scope, key_file, replicas)
        hosts = os.path.join(directory, "hosts")
        with open(hosts, "w", encoding="ascii") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            for i in range(providers):
                for n in range(1, replicas + 1):
                    f.write(f"127.0.0.{n} p{i}.bench\n")
        entries = []
        for i in range(providers):
            host = f"p{i}.bench" if replicas > 1 else "127.0.0.1"
            entries.append(
                {
                    "id": f"p{i}",
                    "baseUrl": f"http://{host}:{port}/v1",
                    # a name other than localhost needs tailnet: true; its addresses are
                    # loopback, which needs no tailscaled
                    "tailnet": replicas > 1,
                    "credentialFile": key_file,
                    "capacityDiscovery": True,
                    "maxConcurrent": 12,
                    "models": {"bench": MODEL},
                }
            )
        config = os.path.join(directory, "gateway.json")
        with open(config, "w", encoding="utf-8") as f:
            json.dump({"maxConcurrent": 4, "providers": entries}, f)
        segment = scope.segment(new_segment_name())
        argv = [*_sidecar_argv(source), "--config", config, "--segment", segment, "--refresh", "1"]
        if replicas > 1:  # the sidecar alone sees a hosts file naming R addresses per host
            script = f'mount --bind {hosts} /etc/hosts && exec "$@"'
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
            argv += [*_sidecar_argv(source), "--config", config, "--segment", segment]
            argv += ["--refresh", "1"]
        log_path = os.path.join(directory, "sidecar.log")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=_source_env(source),
                start_new_session=True,
            )
        scope.popen(proc)
        watched = psutil.Process(proc.pid)
        time.sleep(warmup)
        _check_alive(proc, log_path)
        answers0 = farm_answers(port)
        t0 = time.monotonic()
        c0 = watched.cpu_times()
        peak = 0
        while time.monotonic() - t0 < seconds:
            peak = max(peak, watched.memory_info().rss)
            time.sleep(0.25)
        c1 = watched.cpu_times()
        wall = time.monotonic() - t0
        answers = farm_answers(port) - answers0
        _check_alive(proc, log_path)
        cpu = (c1.user + c1.system) - (c0.user + c0.system)
        return 100.0 * cpu / wall, peak / 2**20, answers / wall


def run_scale(
    cleanup: Cleanup,
    providers: int,
    replicas: int,
    seconds: float = 10.0,
    rounds: int = 3,
    source: str | None = None,
) -> ScaleResult:
    import statistics

    runs = [
        run_scale_round(cleanup, providers, replicas, seconds, source=source) for _ in range(rounds)
    ]
    return ScaleResult(
        providers,
        replicas,
        statistics.median(r[0] for r in runs),
        statistics.median(r[1] for r in runs),
        statistics.median(r[2] for r in runs),
        float(providers * replicas),
    )


def run_costs(cleanup: Cleanup, source: str | None = None) -> dict[str, float]:
    """``sidecar_costs.py`` in a process of its own (of ``source`` when given)."""
    with cleanup.scope() as scope:
        directory = scope.tempdir()
        key_file = os.path.join(directory, "provider.key")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(16).hex() + "\n")
        port, _ = start_farm(scope, key_file, 1)
        done = subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "sidecar_costs.py"),
                "--port",
                str(port),
                "--key-file",
                key_file,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=_source_env(source),
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sidecar_costs failed: {done.stderr[-600:]}")
        costs: dict[str, float] = json.loads(done.stdout)
        return costs


def scale_report(results: list[ScaleResult], costs: dict[str, float]) -> list[str]:
    lines = [
        "providers x replicas   CPU % of a core   peak RSS MiB   answers/s (on time)   "
        "CPU ms per answer",
    ]
    for r in results:
        lines.append(
            f"{r.providers:>9} x {r.replicas:<8}   {r.cpu_percent:>15.1f}   {r.rss_mib:>12.1f}   "
            f"{r.probes_per_s:>8.1f} of {r.expected_per_s:<8g}   {r.cpu_ms_per_probe:>17.2f}"
        )
    lines.append(
        f"in-process: CPU per probe {costs['probe_cpu_ms']:.2f} ms (median of "
        f"{costs['probes']:g}), per publication of 64 changed providers "
        f"{costs['publish_cpu_ms']:.2f} ms (median of {costs['publishes']:g})"
    )
    return lines


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="the sidecar's CPU and RSS as providers and replicas grow"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--source",
        metavar="DIR",
        help="run the sidecar from this source tree (e.g. `git archive REF | tar -x -C DIR`, "
        "with the built shm_layout/_core*.so copied in) to measure another revision",
    )
    parser.add_argument("--scales", default=",".join(f"{p}x{r}" for p, r in SCALES))
    args = parser.parse_args()
    cleanup = Cleanup()
    try:
        results = []
        for text in args.scales.split(","):
            providers, replicas = (int(x) for x in text.split("x"))
            if replicas > 1 and not replicas_possible():
                print(f"{text}: skipped (needs root and unshare for a hosts file)", flush=True)
                continue
            result = run_scale(cleanup, providers, replicas, args.seconds, args.rounds, args.source)
            print(
                scale_report(
                    [result], {"probe_cpu_ms": 0, "probes": 0, "publish_cpu_ms": 0, "publishes": 0}
                )[1],
                flush=True,
            )
            results.append(result)
        costs = run_costs(cleanup, args.source)
        print("\n".join(scale_report(results, costs)))
    finally:
        cleanup.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
