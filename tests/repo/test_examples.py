"""examples/ load as the product reads them; ``router simworker`` serves what the router reads."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from capacity_router.registry import parse_registry
from sidecar.config import load_config
from sidecar.limits import fallback_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CLI = [sys.executable, "-m", "gateway_capacity"]


def test_example_gateway_config_loads_with_discovery_active_on_loopback() -> None:
    config = load_config(EXAMPLES / "gateway.json")
    assert not config.skipped
    ids = [p.id for p in config.providers]
    assert ids == ["local-inference", "cloud-fallback"]
    assert config.statuses["local-inference"].discovery_active
    assert config.statuses["local-inference"].reason == "opt_in_ok:loopback"
    cloud = config.provider("cloud-fallback")
    assert cloud is not None and not config.statuses["cloud-fallback"].discovery_requested
    assert fallback_for(cloud.max_concurrent, config.max_concurrent) == (4, "provider")


def test_the_example_gateway_names_the_known_providers_for_a_mistyped_one() -> None:
    env = {
        **os.environ,
        "GATEWAY_CONFIG": str(EXAMPLES / "gateway.json"),
        "GATEWAY_PROVIDER": "local-inferense",
    }
    ran = subprocess.run(
        [sys.executable, "-c", "import openai_gateway"],
        cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode != 0
    assert ran.stderr.strip() == (
        f"openai_gateway: {EXAMPLES / 'gateway.json'}: no provider 'local-inferense' "
        "(GATEWAY_PROVIDER); did you mean 'local-inference'? (its providers: "
        "local-inference, cloud-fallback)"
    )


def test_example_fallback_is_below_the_example_farm_and_no_ceiling_on_discovery() -> None:
    """One failed probe switches a provider to its fallback at once
    (R-L5), so a fallback above what the farm has (two ten-slot workers: 20) would
    oversubscribe it exactly when the farm is in trouble (docs/limits.md)."""
    config = load_config(EXAMPLES / "gateway.json")
    local = config.provider("local-inference")
    assert local is not None
    farm = 10 * len(parse_registry((EXAMPLES / "workers.json").read_bytes()).workers)
    fallback, source = fallback_for(local.max_concurrent, config.max_concurrent)
    assert fallback < farm and source == "gateway"
    assert local.max_concurrent is None  # a provider maxConcurrent would also cap the 20


def test_example_worker_registry_parses_as_the_router_reads_it() -> None:
    registry = parse_registry((EXAMPLES / "workers.json").read_bytes())
    assert [w.id for w in registry.workers] == ["w1", "w2"]
    assert all(w.slots.source == "props" for w in registry.workers)


def _first_line(proc: subprocess.Popen[str], timeout: float = 20.0) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"{proc.args} printed nothing in {timeout}s")
    return proc.stdout.readline().strip()


def _start(processes: list[subprocess.Popen[str]], *args: str) -> tuple[subprocess.Popen[str], str]:
    """``gateway-capacity ARGS`` as a server (kept in ``processes``) and its first line."""
    proc = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    processes.append(proc)
    return proc, _first_line(proc)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_router_simworker_from_the_shell_serves_what_the_router_sums(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    # the key-file recipe of examples/README.md, as written (umask 077, one line)
    key_file = tmp_path / "local-inference.key"
    subprocess.run(
        f'umask 077 && {sys.executable} -c \'import secrets; print("sk-" + '
        f"secrets.token_urlsafe(32))' > {key_file}",
        shell=True,
        check=True,
    )
    assert key_file.stat().st_mode & 0o777 == 0o600

    urls = []
    for _ in range(2):
        _, line = _start(processes, "router", "simworker", "--slots", "10", "--port", "0")
        assert line.startswith("simulated worker on http://127.0.0.1:"), line
        urls.append(line.split()[3])

    registry = json.loads((EXAMPLES / "workers.json").read_text())
    for entry, url in zip(registry["workers"], urls, strict=True):
        entry["urls"] = [url]  # the example's fixed ports, moved to the ones just bound
    (tmp_path / "workers.json").write_text(json.dumps(registry))
    _, line = _start(
        processes, "router", "serve", "--workers", str(tmp_path / "workers.json"),
        "--key-file", str(key_file), "--listen", "127.0.0.1:0", "--poll", "0.2",
    )  # fmt: skip
    assert line.startswith("serving http://127.0.0.1:"), line
    base = line.removeprefix("serving ").removesuffix("/v1/capacity")

    def workhorse() -> int | None:
        out = subprocess.run(
            [*CLI, "router", "show", "--url", base, "--key-file", str(key_file), "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode != 0:
            return None
        rows = {
            m["id"]: m["max_concurrent_requests"]
            for m in json.loads(out.stdout)["snapshot"]["models"]
        }
        return rows.get("workhorse")

    deadline = time.monotonic() + 20
    while workhorse() != 20 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workhorse() == 20  # two simulated ten-slot workers, summed (R-K5)

    processes[0].send_signal(signal.SIGTERM)
    assert processes[0].wait(timeout=10) == 0  # stops cleanly on SIGTERM
    deadline = time.monotonic() + 20
    while workhorse() != 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workhorse() == 10


def test_router_simworker_refuses_a_non_loopback_host() -> None:
    out = subprocess.run(
        [*CLI, "router", "simworker", "--slots", "10", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--host" in out.stderr


def test_router_simworker_openai_is_an_upstream_to_try_the_gateway_and_wait_for_slot(
    processes: list[subprocess.Popen[str]],
) -> None:
    """`router simworker --openai` answers OpenAI completions (streaming or not, at most
    --slots at once, each taking --delay) and serves llama-swap's vLLM gauges of them,
    which `wait-for-slot` (metrics mode) reads (R-W1). Each completion holds its slot for
    8 s, so the `wait-for-slot` process started while both are in flight samples them
    even on a loaded machine."""
    import concurrent.futures

    import httpx

    _, line = _start(
        processes, "router", "simworker", "--slots", "1", "--openai", "--delay", "8",
        "--model", "workhorse", "--port", "0",
    )  # fmt: skip
    assert "POST /v1/chat/completions" in line and "/upstream/workhorse/metrics" in line, line
    base = line.split()[3]
    ask = {"model": "workhorse", "max_tokens": 2, "messages": [{"role": "user"}]}

    def wait_for_slot(limit: int) -> int:
        return subprocess.run(
            [*CLI, "wait-for-slot", "--url", base, "--model", "workhorse", "--limit",
             str(limit), "--check"],
            capture_output=True,
            text=True,
            timeout=30,
        ).returncode  # fmt: skip

    assert wait_for_slot(1) == 0  # nothing in flight: room
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = [
            pool.submit(httpx.post, f"{base}/v1/chat/completions", json=ask, timeout=60),
            pool.submit(
                httpx.post,
                f"{base}/v1/chat/completions",
                json={**ask, "stream": True},
                timeout=60,
            ),
        ]
        deadline = time.monotonic() + 10
        gauges = ""
        while time.monotonic() < deadline:  # one runs, one waits for the only slot
            gauges = httpx.get(f"{base}/upstream/workhorse/metrics", timeout=5).text
            if 'waiting{model_name="workhorse"} 1.0' in gauges:
                break
            time.sleep(0.05)
        assert 'vllm:num_requests_running{model_name="workhorse"} 1.0' in gauges, gauges
        assert 'vllm:num_requests_waiting{model_name="workhorse"} 1.0' in gauges, gauges
        assert wait_for_slot(2) == 1  # running 1 + waiting 1 + need 1 > 2: no room
        plain, streamed = (a.result() for a in answers)
    assert plain.json()["choices"][0]["message"]["content"] == "t0 t1"
    assert plain.json()["model"] == "workhorse"
    assert streamed.headers["content-type"] == "text/event-stream"
    assert streamed.text.count("data: ") == 3 and streamed.text.endswith("data: [DONE]\n\n")
    assert wait_for_slot(1) == 0


def test_r_l5_the_openai_walk_through_stays_on_the_static_fallback_and_says_so(
    tmp_path: Path, processes: list[subprocess.Popen[str]], key_file: Path, segment_name: str
) -> None:
    """examples/README.md's second walk-through: the example gateway's provider points at
    `router simworker --openai`, which serves no /v1/capacity, so the limit is the
    config's fallback for good. The README prints what `availability` then shows."""
    import httpx

    from handler_shim import Admission

    _, line = _start(
        processes, "router", "simworker", "--openai", "--slots", "2", "--delay", "0.1",
        "--model", "workhorse", "--port", "0",
    )  # fmt: skip
    base = line.split()[3]
    assert httpx.get(f"{base}/v1/capacity", timeout=5).status_code == 404
    doc = json.loads((EXAMPLES / "gateway.json").read_text())
    doc["providers"][0].update(baseUrl=f"{base}/v1", credentialFile=str(key_file))
    config = tmp_path / "my-gateway.json"
    config.write_text(json.dumps(doc))
    env = {**os.environ, "GATEWAY_CAPACITY_SEGMENT": segment_name}

    def local_inference() -> dict[str, object]:
        out = subprocess.run(
            [*CLI, "availability", "--config", str(config), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        (provider,) = [
            p for p in json.loads(out.stdout)["providers"] if p["id"] == "local-inference"
        ]
        return dict(provider)

    # a handler alone (no sidecar): the fallback
    adm = Admission.attach(config=str(config), generation="walk-through", segment=segment_name)
    try:
        alone = local_inference()
        assert (alone["effective_limit"], alone["source"]) == (8, "gateway"), alone
        sidecar = subprocess.Popen(
            [*CLI, "sidecar", "--config", str(config), "--refresh", "1"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(sidecar)
        deadline = time.monotonic() + 20
        probed = local_inference()
        while "no_endpoint" not in str(probed["reason"]) and time.monotonic() < deadline:
            time.sleep(0.2)
            probed = local_inference()
    finally:
        adm.close()
    assert (probed["effective_limit"], probed["source"]) == (8, "gateway"), probed
    readme = (EXAMPLES / "README.md").read_text()
    assert "static fallback" in readme
    assert "limit 8 (gateway)  running 0  waiting 0/32  fallback 8 (gateway)" in readme
    assert f"reason: {probed['reason']}" in readme


def test_r_k5_the_relay_walk_through_reaches_a_discovered_limit_and_sdk_streams(
    tmp_path: Path, processes: list[subprocess.Popen[str]], key_file: Path, segment_name: str
) -> None:
    """examples/README.md's relay walk-through: the provider's baseUrl is `router serve`,
    which both answers /v1/capacity (2 + 3 slots: limit 5, discovered) and relays the
    example gateway's completions to the workers; seven streams from the official
    `openai` SDK then run at most five at a time and all finish."""
    import threading

    import httpx
    import openai
    from gwtest import free_port

    workers = []
    for slots in (2, 3):
        _, line = _start(
            processes, "router", "simworker", "--openai", "--slots", str(slots), "--delay", "3",
            "--model", "workhorse", "--port", "0",
        )  # fmt: skip
        workers.append(line.split()[3])
    registry = tmp_path / "workers.json"
    registry.write_text(
        json.dumps(
            {
                "workers": [
                    {"id": f"w{i}", "urls": [url], "models": ["workhorse"],
                     "slots": {"source": "props"}}
                    for i, url in enumerate(workers, 1)
                ]
            }
        )
    )  # fmt: skip
    _, line = _start(
        processes, "router", "serve", "--workers", str(registry), "--key-file", str(key_file),
        "--listen", "127.0.0.1:0", "--poll", "0.5",
    )  # fmt: skip
    router = line.split()[1].removesuffix("/v1/capacity")
    doc = json.loads((EXAMPLES / "gateway.json").read_text())
    doc["providers"][0].update(baseUrl=f"{router}/v1", credentialFile=str(key_file))
    config = tmp_path / "my-gateway.json"
    config.write_text(json.dumps(doc))
    env = {**os.environ, "GATEWAY_CAPACITY_SEGMENT": segment_name}
    processes.append(
        subprocess.Popen(
            [*CLI, "sidecar", "--config", str(config), "--refresh", "1"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    )

    def local_inference() -> dict[str, object]:
        out = subprocess.run(
            [*CLI, "availability", "--config", str(config), "--json"],
            env=env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if out.returncode != 0:
            return {}
        (p,) = [p for p in json.loads(out.stdout)["providers"] if p["id"] == "local-inference"]
        return dict(p)

    deadline = time.monotonic() + 30
    seen = local_inference()
    while seen.get("effective_limit") != 5 and time.monotonic() < deadline:
        time.sleep(0.3)
        seen = local_inference()
    assert (seen.get("effective_limit"), seen.get("source")) == (5, "discovered"), seen
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(EXAMPLES), "openai_gateway:app",
         "--host", "127.0.0.1", "--port", str(port)],
        env={**env, "GATEWAY_CONFIG": str(config)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    processes.append(gateway)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
    )
    texts: list[str] = []
    peak = [0]
    done = threading.Event()

    def stream() -> None:
        chunks = client.chat.completions.create(
            model="local-workhorse", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    def watch() -> None:
        while not done.is_set():
            running = local_inference().get("running")
            if isinstance(running, int):
                peak[0] = max(peak[0], running)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=stream) for _ in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    done.set()
    watcher.join()
    assert len(texts) == 7 and all(texts), texts
    assert 1 <= peak[0] <= 5, peak
