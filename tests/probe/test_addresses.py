"""Opt-in address checks (R-P1, R-P3): ranges as pure functions, whois against a fake LocalAPI.

A real Tailscale daemon and tailnet are not available here. The range logic is
tested as pure functions; the whois client is tested against a real Unix-socket
HTTP server of our own that answers like tailscaled's LocalAPI (it also refuses
a wrong Host header, as tailscaled does). No request goes to a 100.x address:
probes in this file are either refused before sending or stop at the check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from probe_servers import FakeLocalAPI

from capacity_contract.addresses import (
    LOCALAPI_HOST,
    AddressCheck,
    WhoisResult,
    check_address,
    check_provider_addresses,
    classify,
    parse_host_port,
    parse_ip,
    resolve,
    static_opt_in,
    whois,
)
from sidecar.config import ProviderConfig
from sidecar.probe import probe_provider
from sidecar.replica import ProviderProbe


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.255.254", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped is judged as the IPv4 it maps
        ("0.0.0.0", "other"),
        ("::", "other"),
        ("128.0.0.1", "other"),
        ("100.64.0.0", "tailscale"),
        ("100.127.255.255", "tailscale"),
        ("100.63.255.255", "other"),
        ("100.128.0.0", "other"),
        ("100.115.92.0", "other"),  # ChromeOS VM range
        ("100.115.93.255", "other"),
        ("100.115.94.0", "tailscale"),
        ("100.115.91.255", "tailscale"),
        ("100.100.100.100", "other"),  # Quad100
        ("100.100.100.101", "tailscale"),
        ("::ffff:100.64.0.1", "tailscale"),
        ("fd7a:115c:a1e0::1", "tailscale"),
        ("fd7a:115c:a1e0:ab12:4843:cd96:626b:430b", "tailscale"),
        ("fd7a:115c:a1e0::53", "other"),  # Quad100 v6
        ("fd7a:115c:a1e0:b1a::5", "other"),  # 4via6 subnet routes
        ("fd7a:115c:a1e0:b1b::5", "tailscale"),
        ("fd7a:115c:a1e1::1", "other"),
        ("10.0.0.1", "other"),
        ("192.168.1.1", "other"),
        ("fe80::1", "other"),
    ],
)
def test_r_p1_address_ranges(address: str, kind: str) -> None:
    ip = parse_ip(address)
    assert ip is not None
    assert classify(ip) == kind


def test_r_p1_scoped_link_local_is_never_loopback(tmp_path: Path) -> None:
    assert parse_ip("::1%lo") is None  # a zone names a link, not a host
    verdict = asyncio.run(
        check_address("::1%lo", tailnet=True, socket_path=str(tmp_path / "none.sock"))
    )
    assert not verdict.allowed


@pytest.mark.parametrize(
    ("host", "tailnet", "allowed"),
    [
        ("localhost", False, True),
        ("LOCALHOST.", False, True),
        ("127.0.0.1", False, True),
        ("::1", False, True),
        ("router.example", False, False),
        ("router.tailnet.ts.net", False, False),  # a .ts.net name proves nothing
        ("router.tailnet.ts.net", True, True),  # decided after resolution
        ("100.101.102.103", False, False),
        ("100.101.102.103", True, True),
        ("10.0.0.1", True, False),
        ("100.100.100.100", True, False),
        ("127.0.0.1", True, True),
    ],
)
def test_r_p1_static_opt_in(host: str, tailnet: bool, allowed: bool) -> None:
    assert (static_opt_in(host, tailnet=tailnet) is None) is allowed


def test_r_p3_localhost_resolves_only_to_loopback_addresses() -> None:
    addresses = asyncio.run(resolve("localhost", 80))
    assert addresses
    for a in addresses:
        ip = parse_ip(a)
        assert ip is not None and classify(ip) == "loopback"


def test_r_p3_unresolvable_name_is_a_resolve_error() -> None:
    from capacity_contract.addresses import ResolveError

    with pytest.raises(ResolveError, match="did not resolve"):
        asyncio.run(resolve("no-such-host.invalid", 80))


# --- whois against a LocalAPI of our own -------------------------------------------


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "tailscaled.sock"


def test_r_p1_whois_peer_answer_names_the_peer(socket_path: Path) -> None:
    async def scenario() -> tuple[WhoisResult, list[tuple[str, str]]]:
        async with FakeLocalAPI(socket_path, {"100.101.102.103": "router.tailnet.ts.net"}) as api:
            answer = await whois("100.101.102.103", str(socket_path))
        return answer, api.requests

    answer, requests = asyncio.run(scenario())
    assert answer.answer == "peer"
    assert answer.detail == "tailnet peer router.tailnet.ts.net"
    # IP:port, which every tailscaled version parses (older ones take nothing else)
    assert requests == [("/localapi/v0/whois?addr=100.101.102.103%3A0", LOCALAPI_HOST)]


def test_r_p1_whois_404_means_not_a_peer(socket_path: Path) -> None:
    async def scenario() -> str:
        async with FakeLocalAPI(socket_path, {}):
            return (await whois("100.101.102.104", str(socket_path))).answer

    assert asyncio.run(scenario()) == "not_peer"


def test_r_p1_whois_without_daemon_is_unavailable(tmp_path: Path) -> None:
    answer = asyncio.run(whois("100.101.102.103", str(tmp_path / "none.sock")))
    assert answer.answer == "unavailable"
    assert "no tailscaled at" in answer.detail


@pytest.mark.parametrize("status", [400, 403, 500, 503])
def test_r_p1_a_daemon_that_answers_but_cannot_confirm_a_peer_refuses(
    socket_path: Path, status: int
) -> None:
    """Only "no daemon" falls back to the range check: a 403 (access denied) or a 5xx
    (daemon up, backend down: 100.64/10 may then route to an ISP) must not let the key
    through."""

    async def scenario() -> AddressCheck:
        async with FakeLocalAPI(socket_path, {"100.101.102.103": "router"}, status=status):
            return await check_provider_addresses(
                "100.101.102.103", 443, tailnet=True, socket_path=str(socket_path)
            )

    check = asyncio.run(scenario())
    assert check.refused is not None
    assert f"http_{status}" in check.refused and "cannot confirm a peer" in check.refused


def test_r_p1_ipv6_whois_sends_a_bracketed_address_and_port(socket_path: Path) -> None:
    async def scenario() -> list[tuple[str, str]]:
        async with FakeLocalAPI(socket_path, {}) as api:
            await whois("fd7a:115c:a1e0::1", str(socket_path), 8443)
        return api.requests

    (request,) = asyncio.run(scenario())
    assert request[0] == "/localapi/v0/whois?addr=%5Bfd7a%3A115c%3Aa1e0%3A%3A1%5D%3A8443"


def test_r_p1_an_address_with_a_zone_id_is_never_accepted() -> None:
    assert parse_ip("fd7a:115c:a1e0::53%lo") is None
    assert parse_ip("fe80::1%eth0") is None


def test_r_p1_tailnet_address_of_a_peer_is_allowed(socket_path: Path) -> None:
    async def scenario() -> AddressCheck:
        async with FakeLocalAPI(socket_path, {"100.101.102.103": "router"}):
            return await check_provider_addresses(
                "100.101.102.103", 443, tailnet=True, socket_path=str(socket_path)
            )

    check = asyncio.run(scenario())
    assert check.refused is None
    (verdict,) = check.verdicts
    assert verdict.allowed and verdict.detail == "tailnet peer router"


def test_r_p1_tailnet_address_without_daemon_is_refused_fail_closed(tmp_path: Path) -> None:
    """No tailscaled to vouch for the peer: the CGNAT range alone proves nothing (an ISP
    uses it too), so the address is refused and the refusal says how to proceed."""
    check = asyncio.run(
        check_provider_addresses(
            "100.101.102.103", 443, tailnet=True, socket_path=str(tmp_path / "none.sock")
        )
    )
    assert check.refused is not None
    (verdict,) = check.verdicts
    assert not verdict.allowed
    assert "tailscaled cannot vouch for a peer" in verdict.detail
    assert "range-only" in verdict.detail


def test_r_p1_range_only_tailnet_check_accepts_on_the_range_and_never_asks_the_daemon(
    socket_path: Path,
) -> None:
    async def scenario() -> tuple[AddressCheck, list[tuple[str, str]]]:
        async with FakeLocalAPI(socket_path, {}) as api:  # would say "not a peer"
            check = await check_provider_addresses(
                "100.101.102.103", 443, tailnet=True, socket_path=str(socket_path), range_only=True
            )
        return check, api.requests

    check, requests = asyncio.run(scenario())
    assert check.refused is None and requests == []
    (verdict,) = check.verdicts
    assert verdict.allowed and verdict.detail.startswith("range-checked only (tailnetCheck")


def test_r_p1_range_only_still_refuses_an_address_outside_the_tailscale_ranges(
    tmp_path: Path,
) -> None:
    verdict = asyncio.run(
        check_address(
            "192.0.2.10", tailnet=True, socket_path=str(tmp_path / "none.sock"), range_only=True
        )
    )
    assert not verdict.allowed


def test_r_p1_probe_of_a_tailnet_provider_without_daemon_sends_nothing(
    make_provider: Callable[..., ProviderConfig], no_tailscaled: str
) -> None:
    provider = make_provider("http://100.101.102.103:8080/v1", tailnet=True)
    result = asyncio.run(probe_provider(provider, tailscale_socket=no_tailscaled))
    assert result.replicas == ()
    assert result.refused is not None and result.refused.startswith("address_refused:")
    assert "cannot vouch" in result.refused


def test_r_p1_loopback_address_needs_no_daemon(tmp_path: Path) -> None:
    verdict = asyncio.run(
        check_address("127.0.0.1", tailnet=True, socket_path=str(tmp_path / "none.sock"))
    )
    assert verdict.allowed and verdict.detail == "loopback"


def test_r_p1_public_address_is_refused_even_for_a_tailnet_provider(tmp_path: Path) -> None:
    verdict = asyncio.run(
        check_address("192.0.2.10", tailnet=True, socket_path=str(tmp_path / "none.sock"))
    )
    assert not verdict.allowed


def test_r_p1_probe_of_a_non_peer_is_refused_and_sends_nothing(
    socket_path: Path, make_provider: Callable[..., ProviderConfig]
) -> None:
    provider = make_provider("http://100.101.102.104:8080/v1", tailnet=True)

    async def scenario() -> ProviderProbe:
        async with FakeLocalAPI(socket_path, {"100.101.102.103": "router"}) as api:
            result = await probe_provider(provider, tailscale_socket=str(socket_path))
        assert len(api.requests) == 1
        return result

    result = asyncio.run(scenario())
    assert result.replicas == ()
    refused = result.refused
    assert refused is not None
    assert refused.startswith("address_refused:") and "not a peer" in refused


def test_r_p1_probe_of_a_public_host_is_refused_statically(
    make_provider: Callable[..., ProviderConfig], no_tailscaled: str
) -> None:
    result = asyncio.run(
        probe_provider(make_provider("https://api.example.com/v1"), tailscale_socket=no_tailscaled)
    )
    assert result.replicas == ()
    assert result.refused is not None and result.refused.startswith("opt_in_refused:")


def test_r_p8_a_hanging_resolver_holds_one_thread_and_never_starves_other_providers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name whose lookup hangs (MagicDNS down, say) is looked up once at a time:
    later refreshes join the lookup in flight instead of taking another thread, so
    other providers' lookups keep their threads. (The real resolver cannot be made to
    hang here: getaddrinfo is wrapped for one made-up name.)"""
    import socket
    import threading

    real = socket.getaddrinfo
    release = threading.Event()
    calls = []

    def getaddrinfo(host: str, *args: object, **kwargs: object) -> object:
        if host == "router.hang.test":
            calls.append(host)
            release.wait(30)
            raise socket.gaierror(socket.EAI_AGAIN, "released")
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    async def refresh() -> tuple[str, tuple[str, ...]]:
        async def hung() -> str:
            try:
                async with asyncio.timeout(0.2):
                    await resolve("router.hang.test", 80)
            except TimeoutError:
                return "timeout"
            return "resolved?"

        async def local() -> tuple[str, ...]:
            async with asyncio.timeout(5):
                return await resolve("localhost", 80)

        return await asyncio.gather(hung(), local())

    async def scenario() -> list[tuple[str, tuple[str, ...]]]:
        return [await refresh() for _ in range(12)]  # more than the default pool (cpus + 4)

    try:
        results = asyncio.run(scenario())
    finally:
        release.set()
    assert all(h == "timeout" and loc for h, loc in results)
    assert len(calls) == 1  # one thread ever waited on the hung name


@pytest.mark.parametrize(
    ("text", "empty_host", "expected"),
    [
        ("127.0.0.1:9464", None, ("127.0.0.1", 9464)),
        ("[::1]:0", None, ("::1", 0)),
        ("localhost:8731", None, ("localhost", 8731)),
        (":9464", "127.0.0.1", ("127.0.0.1", 9464)),
    ],
)
def test_listen_address_host_port_is_parsed(
    text: str, empty_host: str | None, expected: tuple[str, int]
) -> None:
    assert parse_host_port(text, empty_host=empty_host) == expected


@pytest.mark.parametrize(
    "text", ["127.0.0.1", "127.0.0.1:70000", "[::1:0", "::1:9464", ":9464", "host:port"]
)
def test_listen_address_without_a_usable_host_port_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"HOST:PORT|port out of range"):
        parse_host_port(text)
