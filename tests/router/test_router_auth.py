"""Bearer auth on the capacity and admin endpoints; key file hygiene (R-K5, R-P7)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from gwtest import wait_for
from router_support import (
    KEY,
    Router,
    Sim,
    get_capacity,
    rows,
    status_from_peer,
    worker,
    write_registry,
)

from capacity_router import KeyFileError, RouterServer, read_key_file
from capacity_router.keyfile import KeyFile


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": "Bearer"},
    ],
    ids=["none", "wrong", "longer", "shorter", "basic", "bare", "empty"],
)
def test_r_k5_capacity_without_the_right_bearer_is_401(
    router: Router, sim: Sim, headers: dict[str, str]
) -> None:
    a = sim(10)
    r = router([worker("a", [a.url], ["wh"])])
    response = httpx.get(f"{r.url}/v1/capacity", headers=headers, trust_env=False)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {"error": "unauthorized"}


def test_r_k5_capacity_with_the_right_bearer_is_200(router: Router, sim: Sim) -> None:
    a = sim(10)
    r = router([worker("a", [a.url], ["wh"])])
    assert get_capacity(r).status_code == 200
    lower = httpx.get(
        f"{r.url}/v1/capacity", headers={"Authorization": f"bearer {KEY}"}, trust_env=False
    )
    assert lower.status_code == 200  # the scheme is case-insensitive (RFC 9110)


def test_r_k5_capacity_is_read_only(router: Router, sim: Sim) -> None:
    a = sim(10)
    r = router([worker("a", [a.url], ["wh"])])
    auth = {"Authorization": f"Bearer {KEY}"}
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        response = httpx.request(method, f"{r.url}/v1/capacity", headers=auth, trust_env=False)
        assert response.status_code == 405
    for path in ("/v1/workers", "/v1/capacity/", "/capacity", "/admin/fence"):
        assert httpx.get(f"{r.url}{path}", headers=auth, trust_env=False).status_code == 404


def test_r_k5_admin_fence_with_a_wrong_key_is_401_and_changes_nothing(
    router: Router, sim: Sim
) -> None:
    a, b = sim(10), sim(10)
    r = router([worker("a", [a.url], ["wh"]), worker("b", [b.url], ["wh"])], poll_interval=30)
    for headers in ({}, {"Authorization": "Bearer nope"}):
        response = httpx.post(f"{r.url}/admin/fence/a", headers=headers, trust_env=False)
        assert response.status_code == 401
    assert rows(r.observe()) == {"wh": 20}
    response = httpx.post(
        f"{r.url}/admin/fence/a", headers={"Authorization": f"Bearer {KEY}"}, trust_env=False
    )
    assert response.status_code == 200
    assert rows(r.snapshot()) == {"wh": 10}


def test_r_k5_admin_refuses_a_non_loopback_peer_even_with_the_key(router: Router, sim: Sim) -> None:
    a = sim(10)
    r = router([worker("a", [a.url], ["wh"])], poll_interval=30)
    request = f"POST /admin/fence/a HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer {KEY}\r\n\r\n"

    def status(peer: str) -> int:
        return status_from_peer(r, peer, request)

    for peer in ("100.64.1.2", "192.0.2.7", "::ffff:10.0.0.1", "fd7a:115c:a1e0::1"):
        assert status(peer) == 403
    assert [w.fenced_by for w in r.workers()] == [None]  # nothing ran
    for peer in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        assert status(peer) == 200
    assert [w.fenced_by for w in r.workers()] == ["admin"]


def test_r_k5_key_rotation_takes_effect_without_restart(
    router: Router, sim: Sim, key_file: Path
) -> None:
    a = sim(10)
    r = router([worker("a", [a.url], ["wh"])], poll_interval=0.2)
    new_key = "rotated-key-0b1e"
    tmp = key_file.with_suffix(".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, new_key.encode() + b"\n")
    os.close(fd)
    os.replace(tmp, key_file)
    wait_for(lambda: get_capacity(r, new_key).status_code == 200)
    assert get_capacity(r, KEY).status_code == 401


def _key(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "k"
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    ("content", "expected"),
    [(b"abc\n", b"abc"), (b"abc\r\n", b"abc"), (b"abc \r\n\n", b"abc"), (b"a.b-c_d~+/=", None)],
)
def test_r_p7_key_file_trailing_newlines_are_stripped(
    tmp_path: Path, content: bytes, expected: bytes | None
) -> None:
    assert read_key_file(_key(tmp_path, content)) == (expected or content)


@pytest.mark.parametrize(
    ("content", "mode", "needle"),
    [
        (b"", 0o600, "empty"),
        (b"\r\n", 0o600, "empty"),
        (b"abc", 0o640, "group or others"),
        (b"abc", 0o604, "group or others"),
        (b"ab c", 0o600, "whitespace"),
        (b"abc\t\n", 0o600, "whitespace"),  # R-P7 trims CR, LF and spaces only, as the probe
        (b"ab\x00c", 0o600, "control"),
        (b"x" * 5000, 0o600, "larger"),
    ],
)
def test_r_p7_unusable_key_file_is_refused_without_showing_the_key(
    tmp_path: Path, content: bytes, mode: int, needle: str
) -> None:
    with pytest.raises(KeyFileError) as info:
        read_key_file(_key(tmp_path, content, mode))
    assert needle in str(info.value)
    if content.strip():
        assert content.decode(errors="replace") not in str(info.value)


def test_r_p7_key_file_must_be_a_regular_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(tmp_path)
    with pytest.raises(KeyFileError, match="cannot open"):
        read_key_file(tmp_path / "absent")


def test_r_p7_router_refuses_to_start_with_a_group_readable_key(
    registry_path: Path, tmp_path: Path
) -> None:
    write_registry(registry_path, [])
    r = RouterServer(registry_path, _key(tmp_path, b"abc", 0o644))
    with pytest.raises(KeyFileError):
        r.start()
    assert not r.running
    assert "zq9-distinct" not in repr(KeyFile(_key(tmp_path, b"zq9-distinct")))
