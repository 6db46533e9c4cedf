"""A loopback worker's port is anyone's while the worker is down (R-K5, R-P7's rule for
the router's own upstreams): the router sends neither the worker's key nor a user's
prompt to a listener that belongs to another user. ``nobody`` is the squatter."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from as_nobody import NobodyListener, need_root
from gwtest import wait_for
from router_support import KEY, Router, write_registry

from capacity_router import SimWorker

AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "my private prompt"
WORKER_KEY = "worker-key-only-the-worker-knows-81d3"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def worker_key_file(tmp_path: Path) -> str:
    path = tmp_path / "gpu1.key"
    path.write_text(WORKER_KEY + "\n")
    path.chmod(0o600)
    return str(path)


def _ask_privately(r: Router) -> httpx.Response:
    """A completion of "my private prompt" for model wh through the router ``r``."""
    with httpx.Client(trust_env=False, timeout=5) as client:
        return client.post(
            f"{r.url}/v1/chat/completions",
            json={"model": "wh", "messages": [{"role": "user", "content": PROMPT}]},
            headers=AUTH,
        )


def _gpu1(port: int, key_file: str, **extra: object) -> dict[str, object]:
    return {
        "id": "gpu1",
        "urls": [f"http://127.0.0.1:{port}"],
        "models": ["wh"],
        "slots": {"source": "props"},
        "keyFile": key_file,
        **extra,
    }


def test_r_k5_nobody_listening_on_a_down_workers_port_gets_neither_its_key_nor_a_prompt(
    router: Router, worker_key_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    need_root()
    caplog.set_level(logging.WARNING, logger="capacity_router")
    with NobodyListener() as squatter:
        r = router([_gpu1(squatter.port, worker_key_file)], poll_interval=0.2)
        wait_for(lambda: r.workers()[0].state is not None, what="a round")
        time.sleep(1.0)  # five rounds
        answer = _ask_privately(r)
        status = r.workers()[0]
        received = squatter.stop()
    assert WORKER_KEY.encode() not in received
    assert received == b"", f"nobody got {received[:200]!r}"
    assert answer.status_code == 503
    assert status.state == "unreachable" and "nobody" in status.reason
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert any("gpu1" in w and "nobody" in w for w in warnings), warnings
    assert sum("nobody" in w for w in warnings) == 1, "said once, not every round"


def test_r_k5_a_worker_that_died_between_rounds_is_not_replaced_by_nobody_for_the_relay(
    router: Router, worker_key_file: str
) -> None:
    need_root()
    sim = SimWorker(slots=4, openai=True, model="wh", api_key=WORKER_KEY)
    port = sim.start()
    try:
        r = router([_gpu1(port, worker_key_file)], poll_interval=30)
        first = r.snapshot()
        assert first is not None
        # start() reads a round, then the loop's own first round begins: let it end.
        wait_for(lambda: (s := r.snapshot()) is not None and s is not first, what="round 2")
        assert r.workers()[0].state == "ok"
    finally:
        sim.stop()
    with NobodyListener(port=port) as squatter:  # before the next round sees gpu1 down
        answer = _ask_privately(r)
        received = squatter.stop()
    assert PROMPT.encode() not in received and WORKER_KEY.encode() not in received
    assert answer.status_code == 502, answer.text


def test_r_k5_a_listener_of_the_named_listener_owner_is_contacted(
    router: Router, worker_key_file: str
) -> None:
    need_root()
    with NobodyListener() as listener:
        r = router([_gpu1(listener.port, worker_key_file, listenerOwner="nobody")])
        wait_for(lambda: r.workers()[0].state is not None, what="a round")
        received = listener.stop()
    assert WORKER_KEY.encode() in received  # nobody is the worker's user here


def test_r_k5_router_check_names_the_stranger_on_a_workers_port(
    registry_path: Path, worker_key_file: str
) -> None:
    need_root()
    with NobodyListener() as squatter:
        write_registry(registry_path, [_gpu1(squatter.port, worker_key_file)])
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway_capacity",
                "router",
                "check",
                "--workers",
                str(registry_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert done.returncode == 0, done.stderr
    assert "gpu1" in done.stdout and "nobody" in done.stdout and "not contacted" in done.stdout


def test_r_k5_a_squatter_newer_than_the_cached_listener_table_is_still_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker is judged on a reading of now, never on a cached listener table that
    predates the squatter (the full suite met this: a table the previous test read, and
    a worker that died and whose port `nobody` took within TABLE_TTL_S)."""
    from capacity_contract import listeners

    need_root()
    monkeypatch.setattr(listeners, "TABLE_TTL_S", 3600.0)
    with NobodyListener() as probe:  # a port, free again once it stops
        port = probe.port
    listeners.listen_table(fresh=True)  # the reading from before the squatter binds
    with NobodyListener(port=port) as squatter:
        refused = listeners.worker_refusal("127.0.0.1", squatter.port, None)
        assert refused is not None and "nobody" in refused
