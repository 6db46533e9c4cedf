"""Share mode against a Redis that asks for a password: read from ``credentialFile``
under the provider key's rules, never in argv or the log."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from as_nobody import NobodyListener
from farm import Farm
from redis_rig import RedisServer
from share_rig import Gateway, wait_for

PASSWORD = "redis-pw-" + secrets.token_hex(12)
GATEWAY_CAPACITY = str(Path(sys.executable).with_name("gateway-capacity"))


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), "--requirepass", PASSWORD)
    server.start()
    yield server
    server.stop()


def _password_file(tmp: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp / "redis.password"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


@contextmanager
def _gateway(
    name: str, tmp: Path, key: str, key_file: Path, redis: RedisServer, password: str | None
) -> Iterator[Gateway]:
    """A gateway of a 9-slot farm whose sidecar reads ``password`` from its credentialFile
    (None: it has none)."""
    farm = Farm(key, 9, grace=1.0)
    extra = {"credentialFile": str(_password_file(tmp, password))} if password else {}
    gw = Gateway(name, tmp, farm, redis, key_file, **extra)
    try:
        yield gw
    finally:
        gw.cleanup()
        farm.stop()


def _strict_check_refuses(gw: Gateway, redis_url: str) -> str:
    """``check-config --strict`` of the gateway's config with ``redis_url``: it must fail
    in words, not a traceback; what it said."""
    doc = json.loads(gw.config.read_text())
    doc["capacityShare"]["redis"] = redis_url
    gw.config.write_text(json.dumps(doc))
    strict = subprocess.run(
        [GATEWAY_CAPACITY, "check-config", "--config", str(gw.config), "--strict"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = strict.stdout + strict.stderr
    assert strict.returncode != 0, out
    assert "Traceback" not in out
    return out


def _sidecar_refuses(gw: Gateway) -> str:
    """Start the sidecar: it must say why in one line and stop; that line."""
    gw.start_sidecar()
    assert gw.sidecar is not None
    assert gw.sidecar.wait(30) != 0
    said = gw.log_text().strip()
    assert len(said.splitlines()) == 1, said
    return said


def _wait_for_a_share(gw: Gateway) -> None:
    wait_for("a share", lambda: (gw.provider() or {}).get("source") == "share" and gw.limit() > 0)


def test_share_reads_the_redis_password_from_its_file_and_never_shows_it(
    tmp_path: Path, key: str, key_file: Path, locked_redis: RedisServer
) -> None:
    with _gateway("gw-a", tmp_path, key, key_file, locked_redis, PASSWORD) as gw:
        gw.start_sidecar()
        _wait_for_a_share(gw)
        assert gw.check().returncode == 0
        assert gw.sidecar is not None
        argv = Path(f"/proc/{gw.sidecar.pid}/cmdline").read_bytes()
        assert PASSWORD.encode() not in argv
    assert PASSWORD not in gw.log_text()


def test_share_with_a_wrong_password_holds_no_share_and_fails_the_check(
    tmp_path: Path, key: str, key_file: Path, locked_redis: RedisServer
) -> None:
    wrong = "not-" + PASSWORD
    with _gateway("gw-b", tmp_path, key, key_file, locked_redis, wrong) as gw:
        gw.start_sidecar()
        wait_for("no share", lambda: "share degraded" in str((gw.provider() or {}).get("reason")))
        assert gw.limit() == 0
        check = gw.check()
        assert check.returncode != 0 and "no share granted yet" in check.stdout
    assert wrong not in gw.log_text() and PASSWORD not in gw.log_text()


def test_share_metrics_say_whether_redis_answers(
    tmp_path: Path, key: str, key_file: Path, locked_redis: RedisServer
) -> None:
    import re
    import urllib.request

    with _gateway("gw-m", tmp_path, key, key_file, locked_redis, PASSWORD) as gw:
        gw.start_sidecar("--metrics-listen", "127.0.0.1:0")
        _wait_for_a_share(gw)
        found = re.search(r"metrics on (http://\S+?:\d+)/metrics", gw.log_text())
        assert found, gw.log_text()
        with urllib.request.urlopen(found.group(1) + "/metrics", timeout=5) as answer:
            text = answer.read().decode()
        assert "# TYPE gateway_capacity_share_redis_up gauge" in text
        assert "gateway_capacity_share_redis_up 1.0" in text
        assert re.search(
            r'gateway_capacity_share_calls_total\{provider="p1",result="ok"\} [1-9]', text
        )
        assert 'gateway_capacity_limit_source{provider="p1",source="share"} 1.0' in text


def test_share_refuses_a_redis_password_in_the_urls_query(
    tmp_path: Path, key: str, key_file: Path, locked_redis: RedisServer
) -> None:
    """redis-py reads every query name of the URL as a connection keyword, so a password
    there would authenticate from a file anyone who reads the config can read; the other
    spellings are in test_share_config.py."""
    with _gateway("gw-q", tmp_path, key, key_file, locked_redis, None) as gw:
        out = _strict_check_refuses(gw, f"{locked_redis.url}?password={PASSWORD}")
        assert "credentialFile" in out and PASSWORD not in out
        said = _sidecar_refuses(gw)
        assert "use credentialFile" in said, said
        assert PASSWORD not in said
        assert locked_redis.client().info("clients")["connected_clients"] == 1  # only ours


def test_share_refuses_a_redis_url_that_redis_py_would_not_build_or_that_sets_its_timeouts(
    tmp_path: Path, key: str, key_file: Path, locked_redis: RedisServer
) -> None:
    """Query options redis-py refuses only when it builds a connection (a bad value, an
    option the connection class does not take) or that override the sidecar's own Redis
    deadlines are refused by check-config and at start, in one line: never a share task
    that dies or fails every turn while the gateway sits at limit 0."""
    with _gateway("gw-u", tmp_path, key, key_file, locked_redis, None) as gw:
        for query, said in (
            ("?db=x", "'db'"),
            ("?ssl_keyfile=/etc/k.pem", "rediss://"),
            ("?socket_timeout=0", "socket_timeout"),
        ):
            out = _strict_check_refuses(gw, locked_redis.url + query)
            assert said in out, out
        logged = _sidecar_refuses(gw)  # with the last URL
        assert "socket_timeout" in logged, logged


def test_r_p7_nobody_listening_on_a_down_redis_port_gets_no_password(
    tmp_path: Path, key: str, key_file: Path, locked_redis: RedisServer
) -> None:
    """While Redis is down any local user may listen on its loopback port: the sidecar
    checks the listener's owner before the handshake (``AUTH``) leaves, refuses one that
    is not root, its own user or a redis/valkey user, and says who in a WARNING."""
    squatter = NobodyListener()
    farm = Farm(key, 9, grace=1.0)
    gw = Gateway(
        "gw-n",
        tmp_path,
        farm,
        locked_redis,
        key_file,
        redis_url=f"redis://127.0.0.1:{squatter.port}/0",
        credentialFile=str(_password_file(tmp_path, PASSWORD)),
    )
    try:
        gw.start_sidecar()
        wait_for("the refusal", lambda: "uid 65534 (nobody)" in gw.log_text())
        time.sleep(1.5)  # several more calls, each refused before anything is sent
        reason = str((gw.provider() or {}).get("reason"))
        assert gw.limit() == 0 and "share degraded" in reason, reason
    finally:
        received = squatter.stop()
        gw.cleanup()
        farm.stop()
    assert PASSWORD.encode() not in received
    assert received == b"", received[:200]
    said = [ln for ln in gw.log_text().splitlines() if "nothing sent to Redis" in ln]
    assert len(said) == 1 and "WARNING" in said[0], said  # once, however often it retries
    assert f"127.0.0.1:{squatter.port} is listened on by uid 65534 (nobody)" in said[0]
    assert "listenerOwner" in said[0]


def test_r_p7_a_loopback_redis_listener_of_another_owner_than_listener_owner_is_refused() -> None:
    """With ``listenerOwner`` the rule is the hop's (capacity_contract/listeners.py); off
    this host a password goes only over TLS."""
    from sidecar.share import peer_problem

    squatter = NobodyListener()
    try:
        mine = peer_problem("127.0.0.1", squatter.port, "root", password=True, tls=False)
        theirs = peer_problem("127.0.0.1", squatter.port, "nobody", password=True, tls=False)
        default = peer_problem("::ffff:127.0.0.1", squatter.port, None, password=False, tls=False)
    finally:
        squatter.stop()
    owner = "is listened on by uid 65534 (nobody), not listenerOwner 'root'"
    assert mine == f"127.0.0.1:{squatter.port} {owner}"
    assert theirs is None
    assert default is not None and "uid 65534 (nobody)" in default
    assert peer_problem("192.0.2.7", 6379, None, password=True, tls=False) is not None
    assert peer_problem("192.0.2.7", 6379, None, password=True, tls=True) is None
    assert peer_problem("192.0.2.7", 6379, None, password=False, tls=False) is None


def test_r_p7_nobody_listening_on_a_sentinels_port_gets_no_sentinel_password(
    tmp_path: Path, key: str, key_file: Path, locked_redis: RedisServer
) -> None:
    """The sentinels' connections are checked as the master's: a sentinel's loopback
    port squatted by ``nobody`` is sent nothing, not its password nor the master's."""
    squatter = NobodyListener()
    farm = Farm(key, 9, grace=1.0)
    sentinel_password = "sentinel-pw-" + secrets.token_hex(12)
    secret_file = tmp_path / "sentinel.password"
    secret_file.write_text(sentinel_password + "\n")
    secret_file.chmod(0o600)
    gw = Gateway(
        "gw-s",
        tmp_path,
        farm,
        locked_redis,
        key_file,
        credentialFile=str(_password_file(tmp_path, PASSWORD)),
    )
    doc = json.loads(gw.config.read_text())
    del doc["capacityShare"]["redis"]
    doc["capacityShare"]["sentinel"] = {
        "master": "gwcap",
        "addresses": [f"127.0.0.1:{squatter.port}"],
        "credentialFile": str(secret_file),
    }
    gw.config.write_text(json.dumps(doc))
    try:
        gw.start_sidecar()
        wait_for("the refusal", lambda: "nothing sent to Redis" in gw.log_text())
        time.sleep(1.5)
        assert gw.limit() == 0
    finally:
        received = squatter.stop()
        gw.cleanup()
        farm.stop()
    assert received == b"", received[:200]
    assert sentinel_password not in gw.log_text() and PASSWORD not in gw.log_text()
    assert "uid 65534 (nobody)" in gw.log_text()
