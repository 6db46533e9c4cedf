"""examples/ load as the product reads them; ``router simworker`` serves what the router reads."""

from __future__ import annotations

import contextlib
import json
import os
import re
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


# --- examples/README.md's walk-throughs, run as pasted ----------------------------------
# Each ```sh block after a `<!-- walk-through: NAME -->` line is run by bash exactly as
# written, in a directory holding a copy of examples/, with this interpreter's bin
# first on PATH. Only the fixed ports are changed, to free ones (tests bind no fixed
# port), in the block and in the copied examples; `pip install` lines are checked
# (the package must import) rather than run.
WALK = re.compile(r"<!-- walk-through: (?P<name>[\w-]+) -->\n```sh\n(?P<body>.*?)\n```", re.S)
PORTS = (8000, 8080, 8081, 8082, 8731)


def _extras(named: str) -> set[str]:
    return {x.strip() for x in named.split(",")}


def test_the_walk_throughs_install_line_and_the_demo_venv_bring_every_command_they_run() -> None:
    """Each program a block runs that a package of ours does not bring itself (uvicorn)
    must come from an extra named on the install line the README gives, and from
    ``make demo``'s venv (whose extras are the Makefile's). Resolved through this venv's
    installed distributions: who provides the console script, who requires whom."""
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement

    readme = (EXAMPLES / "README.md").read_text()
    line = re.search(r"pip install -e '\.\[([\w,]+)\]'", readme)
    assert line is not None, "the walk-throughs' install line"
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"\$\(DEMO_STAMP\):.*?pip install --quiet -e '\.\[([\w,]+)\]'", makefile, re.S)
    assert demo is not None, "make demo's install line"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    scripts = {ep.name: ep.dist for ep in metadata.entry_points(group="console_scripts")}
    run: set[str] = set()
    for name in ("setup", "farm", "openai", "relay"):
        for command in walk_through(name).splitlines():
            words = re.sub(r"^(\w+=\S+\s+)+", "", command.split("#")[0]).split()
            if words and words[0] in scripts and words[0] != "pip":  # pip installs it
                run.add(words[0])
    assert "uvicorn" in run  # what the openai and relay blocks start
    for named in (line[1], demo[1]):
        brought = {Requirement(r).name.lower() for x in _extras(named) for r in extras.get(x, [])}
        for program in sorted(run):
            dist = scripts[program]
            assert dist is not None
            if dist.name.lower() in ("gateway-capacity", "gateway_capacity"):
                continue
            assert dist.name.lower() in brought, (program, named)


def walk_through(name: str) -> str:
    blocks = {m["name"]: m["body"] for m in WALK.finditer((EXAMPLES / "README.md").read_text())}
    return blocks[name]


# A walk-through's own deadline comes before the test's (its timeout mark), so that its
# processes are always ended by end_group, however the test ends.
WALK_S = 150
GRACE_S = 5.0
WALK_TIMEOUT = pytest.mark.timeout(WALK_S + GRACE_S + 30)


def run_walk_through(tmp_path: Path, segment_name: str, *names: str) -> str:
    """The blocks ``names`` (after the setup block) run by one bash; its whole output."""
    from gwtest import free_port

    ports = {str(p): str(free_port()) for p in PORTS}
    work = tmp_path / "checkout"
    (work / "examples").mkdir(parents=True)
    for name in ("gateway.json", "workers.json", "openai_gateway.py"):
        text = (EXAMPLES / name).read_text()
        for old, new in ports.items():
            text = text.replace(f":{old}", f":{new}")
        (work / "examples" / name).write_text(text)
    script = "\n".join(walk_through(n) for n in ("setup", *names))
    for old, new in ports.items():
        script = re.sub(rf"(?<=[:\s]){old}\b", new, script)
    lines = []
    for line in script.splitlines():
        if line.startswith("pip install "):
            for package in line.split("#")[0].split()[2:]:
                pytest.importorskip(package)
            continue
        lines.append(line)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "GATEWAY_CAPACITY_SEGMENT": segment_name,
    }
    log = tmp_path / "walk-through.log"
    with log.open("w") as sink:  # a file, not a pipe: servers left running keep a pipe open
        proc = subprocess.Popen(
            ["bash", "-c", "\n".join(lines)],
            cwd=work, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=WALK_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"not done in {WALK_S} s:\n{log.read_text()}") from None
        finally:
            end_group(proc)
    assert (work / "demo.key").stat().st_mode & 0o777 == 0o600
    return log.read_text()


def end_group(proc: subprocess.Popen[bytes]) -> None:
    """End what a walk-through started, its servers in the background included: SIGTERM
    to its process group, then SIGKILL to whatever of it is left after ``GRACE_S`` (a
    server slow to stop on a loaded machine is still stopped)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            proc.poll()  # reap the shell itself
            os.killpg(proc.pid, 0)  # raises once nothing of the group is left
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)


def test_a_walk_through_s_servers_end_with_it_even_those_that_ignore_sigterm() -> None:
    """What a walk-through leaves running is ended however it ends: a server that does
    not stop on SIGTERM (here one that ignores it) is killed after the grace."""
    proc = subprocess.Popen(
        ["bash", "-c", "trap '' TERM; sleep 300 & echo started; wait"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
    started = time.monotonic()
    end_group(proc)
    proc.wait(timeout=10)
    assert time.monotonic() - started < GRACE_S + 5
    # nothing of the group runs on (a killed orphan may stay a zombie a moment until this
    # host's init reaps it: dead all the same)
    deadline = time.monotonic() + 5.0
    while _running_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running_in_group(proc.pid) == []


def _running_in_group(pgid: int) -> list[int]:
    import psutil

    running = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                running.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return running


@WALK_TIMEOUT
def test_r_k5_the_farm_walk_through_runs_as_pasted_and_follows_the_drain(
    tmp_path: Path, segment_name: str
) -> None:
    out = run_walk_through(tmp_path, segment_name, "farm")
    assert "  probe: ok" in out and "ok, complete: workhorse 20" in out, out
    limits = re.findall(r"local-inference \[discovery\]  limit (\d+) \((\w+)\)", out)
    assert limits == [("20", "discovered"), ("10", "discovered")], out
    assert "Traceback" not in out


@WALK_TIMEOUT
def test_r_l5_the_openai_walk_through_runs_as_pasted_and_stays_on_the_static_fallback(
    tmp_path: Path, segment_name: str
) -> None:
    """examples/README.md's second walk-through: the provider points at `router simworker
    --openai`, which serves no /v1/capacity, so the limit is the config's fallback for
    good. The README prints what `availability` then shows."""
    out = run_walk_through(tmp_path, segment_name, "openai")
    assert "data: [DONE]" in out, out  # the streamed completion, through the gateway
    readme = (EXAMPLES / "README.md").read_text()
    shown = re.search(r"local-inference \[discovery\].*\n  reason: .*", out)
    assert shown is not None, out
    assert shown.group(0) in readme  # the README shows exactly what availability printed
    assert "Traceback" not in out


@WALK_TIMEOUT
def test_r_k5_the_relay_walk_through_runs_as_pasted_and_streams_five_at_a_time(
    tmp_path: Path, segment_name: str
) -> None:
    """The relay walk-through: `router serve` answers /v1/capacity (2 + 3 slots: limit
    5, discovered) and relays the example gateway's completions to the workers; seven
    streams from the official `openai` SDK run five at a time and all finish."""
    out = run_walk_through(tmp_path, segment_name, "relay")
    assert re.search(r"local-inference \[discovery\]  limit 5 \(discovered\)", out), out
    after = [int(s) for s in re.findall(r"completion \d: '.+' after (\d+) s", out)]
    assert len(after) == 7, out
    first, second = min(after), max(after)
    assert after.count(first) == 5 or sorted(after)[4] < sorted(after)[5], out
    assert second >= first + 1, out  # two waited for a slot: about one more --delay
    assert "Traceback" not in out
