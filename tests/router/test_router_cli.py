"""``gateway-capacity router`` as an operator runs it: real processes, real HTTP (R-K5, R-P7)."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_support import KEY, ScriptedServer, Sim, serve_args, worker, write_registry

from capacity_contract import decode_snapshot
from capacity_router.kinds import kind_of

CLI = [sys.executable, "-m", "gateway_capacity", "router"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def read_line(proc: subprocess.Popen[str], timeout: float = 20.0) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError("router printed nothing in time")
    return proc.stdout.readline().strip()


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url

    def capacity(self) -> dict[str, int]:
        response = httpx.get(
            f"{self.url}/v1/capacity", headers={"Authorization": f"Bearer {KEY}"}, trust_env=False
        )
        assert response.status_code == 200
        return {m.id: m.max_concurrent_requests for m in decode_snapshot(response.content).models}

    def terminate(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=20)
        return self.proc.returncode, err


@pytest.fixture
def serve(registry_path: Path, key_file: Path) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(workers: list[dict[str, Any]], *extra: str) -> Served:
        write_registry(registry_path, workers)
        proc = subprocess.Popen(
            [*CLI, *serve_args(registry_path, key_file), "--poll", "30", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = read_line(proc)
        assert line.startswith("serving http://127.0.0.1:") and line.endswith("/v1/capacity")
        served = Served(proc, line.removeprefix("serving ").removesuffix("/v1/capacity"))
        started.append(served)
        return served

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.communicate(timeout=20)


def test_r_k5_fence_and_unfence_through_the_cli_drain_and_restore_a_worker(
    serve: Callable[..., Served], sim: Sim, key_file: Path
) -> None:
    a, b = sim(10), sim(10)
    router = serve([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])])
    assert router.capacity() == {"wh": 20}
    import psutil  # its argv as the kernel shows it, on Linux and macOS

    assert KEY not in " ".join(psutil.Process(router.proc.pid).cmdline())

    outputs: list[str] = []
    fenced = cli("fence", "a", "--url", router.url, "--key-file", str(key_file))
    outputs += [fenced.stdout, fenced.stderr]
    assert fenced.returncode == 0, fenced.stderr
    assert "worker a fenced" in fenced.stdout
    assert "wh: 10" in fenced.stdout
    # --poll 30: only the observation the fence triggered can show this
    assert router.capacity() == {"wh": 10}

    shown = cli("show", "--url", router.url, "--key-file", str(key_file), "--json")
    outputs += [shown.stdout, shown.stderr]
    assert shown.returncode == 0
    shown_doc = json.loads(shown.stdout)
    snapshot = decode_snapshot(json.dumps(shown_doc["snapshot"]).encode())
    assert snapshot.models[0].max_concurrent_requests == 10
    # which workers are fenced, and by what (the capacity endpoint itself never says)
    assert shown_doc["workers"] == [
        {"id": "a", "fenced_by": "admin"},
        {
            "id": "b",
            "fenced_by": None,
            "state": "ok",
            "slots": 10,
            "reason": "props",
            "unserved": [],
            "activity": "",
            "unlisted": [],
            # the simulated llama-server's /props says its slot's n_ctx, nothing in all
            "request_tokens": 4096,
            "running_tokens": None,
            "tokens_from": "n_ctx 4096 a slot",
        },
    ]
    text = cli("show", "--url", router.url, "--key-file", str(key_file))
    assert "workers: 2 registered, 1 fenced" in text.stdout
    assert "a: FENCED (admin: router unfence)" in text.stdout
    assert "b: in service, 10 slots (props)" in text.stdout

    restored = cli("unfence", "a", "--url", router.url, "--key-file", str(key_file), "--json")
    outputs += [restored.stdout, restored.stderr]
    assert restored.returncode == 0, restored.stderr
    answer = json.loads(restored.stdout)
    assert answer["worker"] == "a" and answer["fenced"] is False
    assert answer["snapshot"]["models"] == [
        {"id": "wh", "max_concurrent_requests": 20, "max_request_tokens": 4096}
    ]
    assert router.capacity() == {"wh": 20}

    code, err = router.terminate()
    assert code == 0
    outputs.append(err)
    assert "worker a fenced by the admin endpoint" in err
    assert all(KEY not in text for text in outputs)


def test_r_k5_cli_refusals_exit_1_with_a_reason(
    serve: Callable[..., Served], sim: Sim, key_file: Path, tmp_path: Path
) -> None:
    a = sim(10)
    router = serve([worker("a", [a.url], ["wh"], fenced=True)])
    unknown = cli("fence", "nobody", "--url", router.url, "--key-file", str(key_file))
    assert unknown.returncode == 1
    assert "unknown worker 'nobody'; known: a" in unknown.stderr  # the ids to pick from
    as_json = cli("fence", "nobody", "--url", router.url, "--key-file", str(key_file), "--json")
    assert as_json.returncode == 1 and not as_json.stderr
    assert json.loads(as_json.stdout)["error"].startswith("router refused fence: unknown worker")

    in_file = cli("unfence", "a", "--url", router.url, "--key-file", str(key_file))
    assert in_file.returncode == 1
    assert "fenced in the registry file" in in_file.stderr

    other_key = tmp_path / "other.key"
    other_key.write_text("not-the-router-key\n")
    other_key.chmod(0o600)
    wrong = cli("fence", "a", "--url", router.url, "--key-file", str(other_key))
    assert wrong.returncode == 1
    assert "unauthorized" in wrong.stderr
    assert "not-the-router-key" not in wrong.stdout + wrong.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["fence", "a", "--url", "http://192.0.2.1:8731"], "loopback"),
        (["fence", "a", "--url", "http://user:pw@127.0.0.1:8731"], "credentials"),
        (["fence", "a/../b"], "not a valid worker id"),
        (["show", "--url", "http://127.0.0.1:1"], "cannot reach the router"),
    ],
)
def test_r_k5_cli_usage_and_connection_problems_exit_2(
    key_file: Path, args: list[str], needle: str
) -> None:
    result = cli(*args, "--key-file", str(key_file))
    assert result.returncode == 2
    assert needle in result.stderr
    assert KEY not in result.stdout + result.stderr


def test_r_p7_cli_refuses_a_group_readable_key_file(tmp_path: Path) -> None:
    loose = tmp_path / "loose.key"
    loose.write_text("loose-key-value\n")
    loose.chmod(0o644)
    result = cli("show", "--key-file", str(loose))
    assert result.returncode == 2
    assert "group or others" in result.stderr
    assert "loose-key-value" not in result.stdout + result.stderr


def test_serve_with_a_broken_registry_exits_2_with_one_line(
    registry_path: Path, key_file: Path
) -> None:
    registry_path.write_text('{"workers": [{"id": "a", "fence": true}]}')
    result = cli(*serve_args(registry_path, key_file))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "invalid registry" in result.stderr
    assert str(registry_path) in result.stderr  # which file
    registry_path.write_text('{"workers": [')
    truncated = cli(*serve_args(registry_path, key_file))
    assert truncated.returncode == 2
    assert truncated.stderr.strip() == (
        f"gateway-capacity: registry {registry_path}: invalid JSON: Input data was truncated"
    )


@pytest.mark.parametrize("listen", ["127.0.0.1", "127.0.0.1:70000", "[::1:0"])
def test_serve_with_a_bad_listen_address_exits_2(
    registry_path: Path, key_file: Path, listen: str
) -> None:
    write_registry(registry_path, [])
    result = cli(*serve_args(registry_path, key_file, listen))
    assert result.returncode == 2
    assert "--listen" in result.stderr


def test_serve_on_a_busy_or_foreign_address_exits_2_with_one_line(
    registry_path: Path, key_file: Path
) -> None:
    import socket

    write_registry(registry_path, [])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        for listen, why in (
            (f"127.0.0.1:{port}", "Address already in use"),
            ("10.255.255.1:9999", "Cannot assign requested address"),  # not this host's
        ):
            result = cli(*serve_args(registry_path, key_file, listen))
            assert result.returncode == 2, result
            assert result.stderr.strip() == f"gateway-capacity: cannot listen on {listen}: {why}"


def test_serve_on_ipv6_loopback(registry_path: Path, key_file: Path, sim: Sim) -> None:
    a = sim(10, host="::1")
    write_registry(registry_path, [worker("a", [a.url], ["wh"])])
    proc = subprocess.Popen(
        [*CLI, *serve_args(registry_path, key_file, "[::1]:0")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = read_line(proc)
        assert line.startswith("serving http://[::1]:")
        served = Served(proc, line.removeprefix("serving ").removesuffix("/v1/capacity"))
        assert served.capacity() == {"wh": 10}
        code, _ = served.terminate()
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=20)


def test_serve_exits_0_on_sigterm_promptly(serve: Callable[..., Served], sim: Sim) -> None:
    a = sim(10)
    router = serve([worker("a", [a.url], ["wh"])])
    started = time.monotonic()
    code, err = router.terminate()
    assert code == 0
    assert time.monotonic() - started < 15  # honest margin; it takes well under a second
    assert "Traceback" not in err


def test_r_k1_show_refuses_an_answer_that_is_not_the_contract(
    scripted: Callable[[], ScriptedServer], key_file: Path
) -> None:
    impostor = scripted()
    impostor.route("/v1/capacity", 200, '{"object": "inference_capacity", "version": 2}')
    result = cli("show", "--url", impostor.url, "--key-file", str(key_file))
    assert result.returncode == 1
    assert "invalid snapshot" in result.stderr


WORKER_KEY = "sim-worker-key-41c7"


@pytest.mark.parametrize(
    ("shape", "slots"),
    [
        ("llama-server", {"source": "llama-server"}),
        ("llama-server-router", {"source": "llama-server-router"}),
        ("sglang", {"source": "sglang"}),
        ("tgi", {"source": "tgi"}),
        ("lmstudio", {"source": "lmstudio"}),
        ("vllm", {"source": "vllm", "fixed": 5}),
        ("ollama", {"source": "ollama", "fixed": 5}),
        ("llama-swap", {"source": "llama-swap"}),
    ],
)
def test_r_k5_simworker_shapes_behind_serve_give_a_discovered_limit_and_show_says_which(
    serve: Callable[..., Served], key_file: Path, tmp_path: Path, shape: str, slots: Any
) -> None:
    worker_key = tmp_path / "worker.key"
    worker_key.write_text(WORKER_KEY + "\n")
    worker_key.chmod(0o600)
    args = ["--slots", "5", "--model", "wh", "--shape", shape, "--api-key-file", str(worker_key)]
    sim = subprocess.Popen(
        [*CLI, "simworker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = read_line(sim)
        assert line.startswith("simulated worker on http://127.0.0.1:"), line
        url = line.split()[3]
        entry = worker("w", [url], ["wh", "typo-model"], slots, keyFile=str(worker_key))
        router = serve([entry])
        shown = cli("show", "--url", router.url, "--key-file", str(key_file), "--json")
        listed = json.loads(shown.stdout)["workers"]
        text = cli("show", "--url", router.url, "--key-file", str(key_file))
        assert listed[0]["state"] == "ok"
        if kind_of(slots["source"]).ignores_model:  # it answers any model with its one
            assert router.capacity() == {"typo-model": 5, "wh": 5}
            assert listed[0]["unlisted"] == ["typo-model"]
            assert "lists none of typo-model but serves any model" in text.stdout
        else:
            assert router.capacity() == {"typo-model": 0, "wh": 5}
            assert listed[0]["unserved"] == ["typo-model"]
            assert "does not serve typo-model (counted 0)" in text.stdout
        scraped = httpx.get(
            f"{router.url}/metrics",
            headers={"Authorization": f"Bearer {key_file.read_text().strip()}"},
            trust_env=False,
        )
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(scraped.text)
            for s in family.samples
        }
        state = "gateway_capacity_router_worker_state"
        assert samples[(state, ((state, "ok"), ("worker", "w")))] == 1
        assert samples[("gateway_capacity_router_worker_slots", (("worker", "w"),))] == 5
        running = ("gateway_capacity_router_worker_running_requests", (("worker", "w"),))
        assert samples.get(running, 0) == 0  # an idle worker, where it says
        code, err = router.terminate()
        assert code == 0
        assert "typo-model" in err
        assert WORKER_KEY not in err + shown.stdout + text.stdout + scraped.text
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.communicate(timeout=20)


# -- what a registry, a worker or another spelling of a URL can slip past ----------------

# 128 ids of 253 two-byte characters and a number: each within the id limit (256), and
# together a snapshot of 70,510 bytes at its longest, over the contract's 64 KiB
LONG_IDS = ["é" * 253 + f"{i:03d}" for i in range(128)]


def test_r_p6_a_registry_whose_snapshot_could_pass_64_kib_is_refused_saying_why(
    registry_path: Path, key_file: Path
) -> None:
    write_registry(registry_path, [worker("w", ["http://127.0.0.1:9"], LONG_IDS, {"fixed": 4})])
    for result, code in (
        (cli(*serve_args(registry_path, key_file)), 2),
        (cli("check", "--workers", str(registry_path)), 1),
    ):
        err = result.stderr.strip()
        assert result.returncode == code and len(err.splitlines()) == 1, result
        assert "could reach 78702 bytes, over the contract's 65536" in err, err
        assert "é" * 24 + "…" + "é" * 9 + "000'" in err and "and 19 more)" in err  # named


def test_r_p6_show_refuses_an_answer_over_64_kib(
    scripted: Callable[[], ScriptedServer], key_file: Path
) -> None:
    rows = [{"id": m, "max_concurrent_requests": 4096} for m in LONG_IDS]
    body = json.dumps(
        {
            "object": "inference_capacity",
            "version": 1,
            "complete": True,
            "observed_at": time.time(),
            "models": rows,
        },
        ensure_ascii=False,
    )
    impostor = scripted()
    impostor.route("/v1/capacity", 200, body.encode())
    result = cli("show", "--url", impostor.url, "--key-file", str(key_file))
    assert result.returncode == 1
    assert "over the contract's 65536" in result.stderr, result.stderr


FORGED = "x\n  w2: FENCED (in the registry file)\x1b[31m\x1b[2J\u202e"
GONE = "gone\n2026-12-04T00:00:00.000Z INFO router: worker w2: fenced\x1b[2J"


def test_r_k5_show_and_the_log_escape_what_a_worker_says(
    serve: Callable[..., Served], key_file: Path
) -> None:
    """A llama-swap worker's model names reach ``router show`` (its activity), and an id
    it does not serve the router's log: neither may forge a line or send a terminal
    escape."""
    from capacity_router.simworker import SimWorker

    swap = SimWorker(slots=4, shape="llama-swap", model="wh")
    swap.start()
    try:
        swap.set_model_state("wh", "loaded")
        swap.set_model_state(FORGED, "loaded")
        router = serve(
            [
                worker("w1", [swap.url], ["wh", GONE], {"source": "llama-swap"}),
                worker("w2", ["http://127.0.0.1:9"], ["wh"], {"fixed": 4}),
            ]
        )
        assert router.capacity() == {"wh": 4, GONE: 0}
        text = cli("show", "--url", router.url, "--key-file", str(key_file)).stdout
        _, err = router.terminate()
    finally:
        swap.stop()
    assert "\x1b" not in text + err and "\u202e" not in text + err
    assert "workers: 2 registered, 0 fenced" in text
    assert [line for line in text.splitlines() if line.startswith("  w2:")] == [
        "  w2: not fenced, unreachable, its slots count 0 (connection failed)"
    ]
    assert "running: wh, x\\n  w2: FENCED (in the registry file)\\x1b[31m\\x1b[2J\\u202e" in text
    assert "worker w1 does not serve gone\\n2026-12-04T00:00:00.000Z INFO" in err
    assert not [line for line in err.splitlines() if "w2: fenced" in line and "gone" not in line]


def test_router_check_prints_the_workers_and_model_ids_and_names_a_refused_registry(
    registry_path: Path, tmp_path: Path
) -> None:
    workers = [
        worker("a", ["http://127.0.0.1:9"], ["wh", "wh-long"], {"source": "props"}),
        {**worker("b", ["http://127.0.0.1:10"], ["wh"], {"fixed": 4}), "fenced": True},
    ]
    write_registry(registry_path, workers)
    check = cli("check", "--workers", str(registry_path))
    assert check.returncode == 0, check
    lines = check.stdout.splitlines()
    assert lines[0].startswith(f"registry {registry_path}: 2 workers, 2 model ids; ")
    assert lines[1] == "  worker a: http://127.0.0.1:9; models wh, wh-long; slots from props"
    assert lines[2] == (
        "  worker b: http://127.0.0.1:10; models wh; slots from fixed, fixed 4; "
        "FENCED in the registry file (counts 0)"
    )
    assert lines[3] == "model ids: wh, wh-long"
    # a misspelt key: the file named, the key it resembles, one line, exit 1
    broken = tmp_path / "typo.json"
    broken.write_text(
        json.dumps({"workers": [{**worker("a", ["http://127.0.0.1:9"], ["wh"]), "fence": True}]})
    )
    refused = cli("check", "--workers", str(broken))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    err = refused.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert str(broken) in err and "unknown field `fence`" in err, err
    assert "did you mean 'fenced'?" in err, err


def test_r_k5_two_workers_on_one_socket_address_are_a_warning_in_check_show_and_the_log(
    serve: Callable[..., Served], key_file: Path, registry_path: Path, sim: Sim
) -> None:
    one = sim(4)
    port = one.url.rsplit(":", 1)[1]
    workers = [
        worker("a", [f"http://127.0.0.1:{port}"], ["wh"], {"source": "props"}),
        worker("b", [f"http://localhost:{port}/"], ["wh"], {"source": "props"}),
    ]
    write_registry(registry_path, workers)
    check = cli("check", "--workers", str(registry_path))
    assert check.returncode == 0, check
    said = f"workers 'a' (http://127.0.0.1:{port}) and 'b' (http://localhost:{port}/) resolve "
    said += f"to one socket address 127.0.0.1:{port}"
    assert [x for x in check.stdout.splitlines() if x.startswith("warning:")] == [
        f"warning: {said}: if they are one server, its slots count twice; list both URLs "
        "under one id"
    ]
    # R-K7: where each worker's token capacity is read from
    assert "  a (props): tokens from /props n_ctx a slot, /v1/models meta.n_ctx in all" in (
        check.stdout.splitlines()
    )
    router = serve(workers)
    assert router.capacity() == {"wh": 8}  # counted twice: a warning, not a refusal
    for _ in range(50):  # the names are resolved beside the rounds
        text = cli("show", "--url", router.url, "--key-file", str(key_file)).stdout
        if "warning:" in text:
            break
        time.sleep(0.1)
    warned = [x for x in check.stdout.splitlines() if x.startswith("warning:")]
    assert warned[0] in text.splitlines()
    _, err = router.terminate()
    assert err.count(said) == 1, err


def test_router_show_says_what_a_worker_that_is_not_fenced_but_not_counted_means() -> None:
    from gateway_capacity.cmd_router import _describe_workers

    text = _describe_workers(
        [
            {"id": "a", "state": "ok", "slots": 4, "reason": "props"},
            {"id": "b", "state": "unreadable", "reason": "props timed out"},
            {"id": "c", "state": "unreachable", "reason": "connection refused"},
            {"id": "d", "fenced_by": "admin", "state": "ok"},
        ],
        [],
    )
    assert text.splitlines() == [
        "workers: 4 registered, 1 fenced",
        "  a: in service, 4 slots (props); tokens: not stated (slots only)",
        "  b: not fenced, answers but its slots cannot be read, so the snapshot is incomplete "
        "(props timed out)",
        "  c: not fenced, unreachable, its slots count 0 (connection refused)",
        "  d: FENCED (admin: router unfence)",
    ]


def test_r_k7_router_show_says_tokens_per_worker_and_per_model() -> None:
    from gateway_capacity.cmd_router import _describe_snapshot, _describe_workers

    workers = _describe_workers(
        [
            {
                "id": "a",
                "state": "ok",
                "slots": 2,
                "reason": "props",
                "request_tokens": 256,
                "running_tokens": 512,
                "tokens_from": "n_ctx 256 a slot, 512 in all",
            },
            {"id": "m", "state": "ok", "slots": 4, "reason": "mlx"},
        ],
        [],
    )
    assert workers.splitlines()[1:] == [
        "  a: in service, 2 slots (props); tokens: 256 a request, 512 running "
        "(n_ctx 256 a slot, 512 in all)",
        "  m: in service, 4 slots (mlx); tokens: not stated (slots only)",
    ]
    rows = [
        {
            "id": "tiny",
            "max_concurrent_requests": 2,
            "max_request_tokens": 256,
            "max_running_tokens": 512,
        },
        {"id": "mlx", "max_concurrent_requests": 4},
    ]
    snapshot = _describe_snapshot({"observed_at": 0, "complete": True, "models": rows})
    assert snapshot.splitlines()[1:] == [
        "  tiny: 2 (tokens: 256 a request, 512 running)",
        "  mlx: 4 (tokens: slots only)",
    ]


def test_r_k5_an_ipv4_mapped_ipv6_spelling_of_one_socket_is_a_warning_too(
    registry_path: Path, sim: Sim
) -> None:
    """``[::ffff:127.0.0.1]`` reaches a server listening on 127.0.0.1 (a dual-stack
    socket connects to it): two ids over the two spellings count one server twice."""
    import httpx

    one = sim(4)
    port = one.url.rsplit(":", 1)[1]
    mapped = f"http://[::ffff:127.0.0.1]:{port}"
    assert httpx.get(f"{mapped}/health", timeout=10).status_code == 200  # one server
    workers = [
        worker("a", [f"http://127.0.0.1:{port}"], ["wh"], {"source": "props"}),
        worker("b", [mapped], ["wh"], {"source": "props"}),
    ]
    write_registry(registry_path, workers)
    check = cli("check", "--workers", str(registry_path))
    assert check.returncode == 0, check
    warned = [x for x in check.stdout.splitlines() if x.startswith("warning:")]
    assert len(warned) == 1 and f"one socket address 127.0.0.1:{port}" in warned[0], check
