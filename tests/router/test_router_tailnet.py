"""A worker that is not on loopback is contacted only on an address that is a peer of this
tailnet, pinned from the check to the connection (R-K5, with R-P1 and R-P3's rule for the
probe's hop): a name that resolves elsewhere gets neither the worker's key nor a prompt.

tailscaled cannot run here (no tailnet, no TUN device): its LocalAPI is a fake of our own
on a Unix socket (``_LocalAPI``), answering ``whois`` as tailscaled does (200 for a peer,
404 otherwise). Names are resolved by a patched ``socket.getaddrinfo`` in this process (a
test may not touch /etc/hosts); the one address a name may resolve to that is not loopback
and still reaches a local listener is ``0.0.0.0`` (Linux hands a connection to it to the
loopback), which is what ``nobody`` listens behind. No packet leaves the loopback: a
Tailscale address is checked, never connected to.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from as_nobody import NobodyListener, need_root
from gwtest import wait_for
from router_support import KEY, write_registry

from capacity_contract.addresses import SOCKET_ENV
from capacity_router import SimWorker, Worker
from capacity_router.pinning import route_of
from capacity_router.poller import new_client, pinned_url, poll_url
from capacity_router.registry import SlotSource

AUTH = {"Authorization": f"Bearer {KEY}"}
WORKER_KEY = "worker-key-only-the-worker-knows-5c1e"
ROOT = Path(__file__).resolve().parents[2]
PEER = "100.101.102.103"
NOT_PEER = "100.101.102.104"


class _LocalAPI:
    """tailscaled's ``GET /localapi/v0/whois?addr=IP:PORT`` on a Unix socket: 200 and the
    node's name for a peer, 404 for any other address."""

    def __init__(self, path: Path, peers: dict[str, str]) -> None:
        self.asked: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                addr = parse_qs(urlsplit(self.path).query).get("addr", [""])[0]
                ip = addr.rpartition(":")[0].strip("[]")
                api.asked.append(ip)
                if ip in peers:
                    body = json.dumps({"Node": {"Name": peers[ip] + "."}}).encode()
                    self.send_response(200)
                else:
                    body = b"no match\n"
                    self.send_response(404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def address_string(self) -> str:
                return "unix"

            def log_message(self, *args: Any) -> None:
                pass

        self._server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def localapi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_LocalAPI]:
    path = tmp_path / "tailscaled.sock"
    monkeypatch.setenv(SOCKET_ENV, str(path))
    api = _LocalAPI(path, {PEER: "gpu-peer.tailnet.example.ts.net"})
    yield api
    api.stop()


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Names this process resolves as the test says (everything else as before)."""
    table: dict[str, list[str]] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, bytes):  # anyio (httpx) asks with the name IDNA-encoded
            host = host.decode("ascii")
        if host in table:
            return [
                (
                    socket.AF_INET6 if ":" in ip else socket.AF_INET,
                    socket.SOCK_STREAM,
                    6,
                    "",
                    (ip, int(port or 0)),
                )
                for ip in table[host]
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table


@pytest.fixture
def worker_key_file(tmp_path: Path) -> str:
    path = tmp_path / "gpu.key"
    path.write_text(WORKER_KEY + "\n")
    path.chmod(0o600)
    return str(path)


def _worker(url: str, key_file: str, **extra: object) -> dict[str, object]:
    return {
        "id": "gpu2",
        "urls": [url],
        "models": ["wh"],
        "slots": {"source": "props"},
        "keyFile": key_file,
        **extra,
    }


def _ask(url: str) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=10) as client:
        return client.post(
            f"{url}/v1/chat/completions",
            json={"model": "wh", "messages": [{"role": "user", "content": "my private prompt"}]},
            headers=AUTH,
        )


@pytest.mark.parametrize("host", ["gpu2.tailnet.test", "0.0.0.0"])
def test_r_k5_a_worker_name_resolving_to_a_non_peer_gets_neither_key_nor_prompt(
    router: Any,
    worker_key_file: str,
    names: dict[str, list[str]],
    localapi: _LocalAPI,
    caplog: pytest.LogCaptureFixture,
    host: str,
) -> None:
    need_root()
    caplog.set_level(logging.WARNING, logger="capacity_router")
    names["gpu2.tailnet.test"] = ["0.0.0.0"]  # reaches whoever listens on the loopback port
    with NobodyListener() as squatter:
        r = router([_worker(f"http://{host}:{squatter.port}", worker_key_file)])
        wait_for(lambda: r.workers()[0].state is not None, what="a round")
        time.sleep(1.0)  # five rounds
        answer = _ask(r.url)
        status = r.workers()[0]
        received = squatter.stop()
    assert WORKER_KEY.encode() not in received and b"my private prompt" not in received
    assert received == b"", f"nobody got {received[:200]!r}"
    assert answer.status_code == 503, answer.text
    assert status.state == "unreachable"
    assert "not contacted" in status.reason and "neither loopback nor a Tailscale" in status.reason
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    said = [w for w in warnings if "gpu2" in w and "0.0.0.0" in w]
    assert len(said) == 1, warnings  # said once, not every round


def test_r_k5_a_name_with_one_refused_address_is_refused_whole(
    router: Any, worker_key_file: str, names: dict[str, list[str]], localapi: _LocalAPI
) -> None:
    need_root()
    sim = SimWorker(slots=4, openai=True, model="wh", api_key=WORKER_KEY)
    port = sim.start()
    try:
        with NobodyListener() as squatter:
            # the real worker on 127.0.0.1, and an address nobody listens behind
            names["gpu2.tailnet.test"] = ["127.0.0.1", "0.0.0.0"]
            r = router([_worker(f"http://gpu2.tailnet.test:{port}", worker_key_file)])
            wait_for(lambda: r.workers()[0].state is not None, what="a round")
            status = r.workers()[0]
            squatter.stop()
    finally:
        sim.stop()
    assert status.state == "unreachable" and "0.0.0.0" in status.reason, status


def test_r_k5_a_worker_name_on_a_checked_address_is_polled_and_relayed_there(
    router: Any, worker_key_file: str, names: dict[str, list[str]], localapi: _LocalAPI
) -> None:
    """The pinned connection keeps the URL's Host: the worker answers as under its name."""
    sim = SimWorker(slots=4, openai=True, model="wh", api_key=WORKER_KEY, delay=0.0)
    port = sim.start()
    try:
        names["gpu2.tailnet.test"] = ["127.0.0.1"]
        r = router([_worker(f"http://gpu2.tailnet.test:{port}", worker_key_file)])
        wait_for(lambda: r.workers()[0].state == "ok", what="the worker polled")
        answer = _ask(r.url)
    finally:
        sim.stop()
    assert answer.status_code == 200, answer.text


def test_r_k5_whois_decides_a_tailscale_address_and_no_daemon_refuses(
    localapi: _LocalAPI, names: dict[str, list[str]], tmp_path: Path
) -> None:
    names["peer.tailnet.test"] = [PEER]
    names["stranger.tailnet.test"] = [NOT_PEER]
    socket_path = str(tmp_path / "tailscaled.sock")

    async def routes() -> list[Any]:
        return [
            await route_of("http://peer.tailnet.test:8080", None, socket_path=socket_path),
            await route_of("http://stranger.tailnet.test:8080", None, socket_path=socket_path),
            await route_of(
                "http://peer.tailnet.test:8080", None, socket_path=str(tmp_path / "none.sock")
            ),
            await route_of(
                "http://stranger.tailnet.test:8080",
                None,
                "range-only",
                socket_path=str(tmp_path / "none.sock"),
            ),
            await route_of("http://10.0.0.7:8000", None, "range-only", socket_path=socket_path),
        ]

    peer, stranger, no_daemon, range_only, lan = asyncio.run(routes())
    assert peer.addresses == (PEER,) and peer.refused is None
    assert stranger.addresses == () and "not a peer" in (stranger.refused or "")
    assert no_daemon.addresses == () and "cannot vouch" in (no_daemon.refused or "")
    assert range_only.addresses == (NOT_PEER,)  # the operator's choice: the range alone
    assert lan.addresses == () and "neither loopback nor a Tailscale" in (lan.refused or "")
    assert localapi.asked == [PEER, NOT_PEER]


def test_r_k5_the_pinned_url_names_the_checked_address() -> None:
    assert pinned_url("http://gpu.ts.net:8080/up/x", PEER) == f"http://{PEER}:8080/up/x"
    assert pinned_url("https://gpu.ts.net/v", "fd7a:115c:a1e0::1") == (
        "https://[fd7a:115c:a1e0::1]:443/v"
    )
    assert pinned_url("http://127.0.0.1:9/", "127.0.0.1") == "http://127.0.0.1:9/"


def test_r_k5_router_check_names_a_worker_on_a_non_peer_address(
    registry_path: Path, worker_key_file: str, tmp_path: Path
) -> None:
    write_registry(registry_path, [_worker("http://10.0.0.7:8000", worker_key_file)])
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
        env={"PATH": "/usr/bin:/bin", SOCKET_ENV: str(tmp_path / "none.sock")},
    )
    assert done.returncode == 0, done.stderr
    assert "gpu2" in done.stdout and "not contacted" in done.stdout
    assert "neither loopback nor a Tailscale" in done.stdout


def test_r_k5_a_tailscaled_that_never_answers_costs_one_poll_deadline_and_sends_nothing(
    names: dict[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LocalAPI that takes the connection and never answers (a daemon stopped with
    SIGSTOP): the poll ends at its deadline, unreachable, and no key goes anywhere."""
    path = tmp_path / "stopped.sock"
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(path))
    hung.listen(8)  # accepted by the kernel, never read
    monkeypatch.setenv(SOCKET_ENV, str(path))
    names["gpu2.tailnet.test"] = [PEER]
    url = "http://gpu2.tailnet.test:8080"
    worker = Worker(id="gpu2", urls=(url,), models=("wh",), slots=SlotSource(source="props"))

    async def go() -> tuple[Any, float]:
        started = time.monotonic()
        async with new_client(0.5) as client:
            seen = await poll_url(client, worker, url, 0.5, WORKER_KEY.encode())
        return seen, time.monotonic() - started

    try:
        seen, took = asyncio.run(go())
    finally:
        hung.close()
    assert seen.state == "unreachable" and seen.reason == "timed out", seen
    assert took < 5.0  # one deadline of 0.5 s, with room for a busy machine
