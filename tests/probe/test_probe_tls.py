"""https providers: the connection is pinned to the resolved address while TLS verifies,
and SNI names, the configured host (R-P3), with certificates from trustme."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

import pytest
import trustme
from probe_servers import RawServer, body_of, fixed, snapshot

from sidecar.config import ProviderConfig
from sidecar.probe import probe_provider
from sidecar.replica import ProviderProbe

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_context(ca: trustme.CA, *names: str, seen_sni: list[str | None]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(ctx)

    def remember(_obj: Any, server_name: str | None, _ctx: Any) -> None:
        seen_sni.append(server_name)

    ctx.sni_callback = remember
    return ctx


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    return ctx


def run_https(
    ca: trustme.CA,
    cert_names: tuple[str, ...],
    make_provider: Callable[..., ProviderConfig],
    socket_path: str,
    *,
    trust: ssl.SSLContext | None,
) -> tuple[ProviderProbe, RawServer, list[str | None]]:
    seen_sni: list[str | None] = []

    async def scenario() -> tuple[ProviderProbe, RawServer]:
        ctx = server_context(ca, *cert_names, seen_sni=seen_sni)
        async with RawServer(fixed(200, body_of(snapshot(NOW))), ssl_context=ctx) as srv:
            provider = make_provider(f"https://localhost:{srv.port}/v1")
            result = await probe_provider(
                provider, tailscale_socket=socket_path, ssl_context=trust, now_fn=lambda: NOW
            )
        return result, srv

    result, srv = asyncio.run(scenario())
    return result, srv, seen_sni


def test_r_p3_https_localhost_pinned_to_127_0_0_1_verifies_the_name_not_the_address(
    ca: trustme.CA, make_provider: Callable[..., ProviderConfig], no_tailscaled: str
) -> None:
    # the certificate names only "localhost": verifying against the pinned IP would fail
    result, srv, seen_sni = run_https(
        ca, ("localhost",), make_provider, no_tailscaled, trust=client_context(ca)
    )
    assert result.refused is None
    by_address = {r.address: r for r in result.replicas}
    assert by_address["127.0.0.1"].ok, by_address["127.0.0.1"]
    assert set(by_address) <= {"127.0.0.1", "::1"}  # localhost may also resolve to ::1
    assert "localhost" in seen_sni
    assert srv.requests[0].headers["host"] == f"localhost:{srv.port}"


def test_r_p3_certificate_for_another_name_fails_and_no_request_is_sent(
    ca: trustme.CA, make_provider: Callable[..., ProviderConfig], no_tailscaled: str
) -> None:
    result, srv, _ = run_https(
        ca, ("router.example",), make_provider, no_tailscaled, trust=client_context(ca)
    )
    replica = {r.address: r for r in result.replicas}["127.0.0.1"]
    assert replica.reason == "unreachable"
    assert "CERTIFICATE_VERIFY_FAILED" in replica.detail
    assert srv.requests == []  # the key never left the TLS handshake


def test_r_p3_unknown_ca_is_refused_by_default(
    ca: trustme.CA, make_provider: Callable[..., ProviderConfig], no_tailscaled: str
) -> None:
    result, srv, _ = run_https(ca, ("localhost",), make_provider, no_tailscaled, trust=None)
    replica = {r.address: r for r in result.replicas}["127.0.0.1"]
    assert replica.reason == "unreachable"
    assert srv.requests == []
