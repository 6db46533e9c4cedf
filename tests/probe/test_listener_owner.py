"""Who listens on a loopback provider's port before the key goes there (R-P7).

While the router is down any local user can listen on its port; the listener
here really belongs to ``nobody`` (a forked child that dropped to uid 65534).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from probe_servers import RawServer, body_of, fixed, snapshot

from capacity_contract import listeners
from sidecar import probe as probe_module
from sidecar.config import ProviderConfig, parse_config
from sidecar.probe import probe_provider
from sidecar.replica import ProviderProbe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from as_nobody import NobodyListener

MakeProvider = Callable[..., ProviderConfig]


def probe_router(
    make_provider: MakeProvider, socket_path: str, **fields: object
) -> tuple[ProviderProbe, int]:
    """Probe a root-owned router on 127.0.0.1; also how many requests it got."""

    async def scenario() -> tuple[ProviderProbe, int]:
        async with RawServer(fixed(200, body_of(snapshot(time.time())))) as router:
            provider = make_provider(f"http://{router.netloc}/v1", **fields)
            result = await probe_provider(provider, tailscale_socket=socket_path)
        return result, len(router.requests)

    return asyncio.run(scenario())


# /proc/net/tcp and tcp6 lines (header and trailing columns shortened)
TCP = "\n".join(
    [
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid",
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000 0 1",
        "   1: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0 0 2",
        "   2: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000    33 0 3",
    ]
)
TCP6 = "\n".join(
    [
        "  sl  local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt   uid",
        "   0: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A "
        "00000000:00000000 00:00000000 00000000   65534 0 4",
    ]
)


@pytest.mark.skipif(sys.byteorder != "little", reason="sample lines from a little-endian host")
def test_r_p7_proc_net_tcp_listeners_are_read_with_their_owner_uid() -> None:
    table = listeners.parse_proc_net_tcp(TCP)
    assert table == {("127.0.0.1", 8080): frozenset({1000}), ("0.0.0.0", 80): frozenset({0})}
    assert listeners.parse_proc_net_tcp(TCP6) == {("::1", 8081): frozenset({65534})}


@pytest.fixture
def fresh_table() -> Iterator[None]:
    listeners._cached = None  # another test's reading must not answer for this one
    yield
    listeners._cached = None


def test_r_p7_a_listener_of_another_user_than_listener_owner_gets_no_key(
    make_provider: MakeProvider, no_tailscaled: str, key: str, fresh_table: None
) -> None:
    with NobodyListener() as squatter:
        provider = make_provider(f"http://127.0.0.1:{squatter.port}/v1", listener_owner="root")
        result = asyncio.run(probe_provider(provider, tailscale_socket=no_tailscaled))
    assert result.replicas == ()
    assert result.refused == (
        f"listener_refused:127.0.0.1:{squatter.port} is listened on by uid 65534 (nobody), "
        "not listenerOwner 'root'"
    )
    assert squatter.received == b""  # not even a connection carrying the key


def test_r_p7_a_listener_of_the_named_owner_is_probed(
    make_provider: MakeProvider, no_tailscaled: str, key: str, fresh_table: None
) -> None:
    result, requests = probe_router(make_provider, no_tailscaled, listener_owner=0)
    assert result.refused is None and [r.reason for r in result.replicas] == ["ok"]
    assert requests == 1


def test_r_p7_with_listener_owner_nothing_listening_is_refused(
    make_provider: MakeProvider, no_tailscaled: str, fresh_table: None
) -> None:
    with NobodyListener() as gone:
        port = gone.port
    provider = make_provider(f"http://127.0.0.1:{port}/v1", listener_owner="root")
    result = asyncio.run(probe_provider(provider, tailscale_socket=no_tailscaled))
    assert result.refused == f"listener_refused:nothing listens on 127.0.0.1:{port}"


def test_r_p7_without_listener_owner_a_foreign_listener_is_warned_about_once(
    make_provider: MakeProvider,
    no_tailscaled: str,
    key: str,
    caplog: pytest.LogCaptureFixture,
    fresh_table: None,
) -> None:
    """No owner named: the key still goes (the operator did not say who should listen),
    and the WARNING says once who got it and what to set."""
    with NobodyListener() as squatter:
        provider = make_provider(f"http://127.0.0.1:{squatter.port}/v1")
        with caplog.at_level(logging.WARNING, logger="sidecar.probe"):
            for _ in range(2):
                listeners._cached = None
                probe_module._last_unset_check.clear()  # looked at every probe, here
                asyncio.run(probe_provider(provider, tailscale_socket=no_tailscaled))
    warnings = [r.getMessage() for r in caplog.records if "listened on by" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "uid 65534 (nobody)" in warnings[0] and "listenerOwner" in warnings[0]
    assert key not in warnings[0]
    assert b"Authorization: Bearer" in squatter.received


def test_r_p7_listener_owner_where_the_platform_cannot_tell_is_refused(
    make_provider: MakeProvider,
    no_tailscaled: str,
    key: str,
    monkeypatch: pytest.MonkeyPatch,
    fresh_table: None,
) -> None:
    """macOS has no /proc/net/tcp: the platform layer answers None and a provider that
    asked for the check is refused (fail closed)."""
    monkeypatch.setattr(listeners, "table_reader", lambda: None)
    result, requests = probe_router(make_provider, no_tailscaled, listener_owner="root")
    assert requests == 0
    assert result.refused is not None
    assert "cannot tell who listens" in result.refused


@pytest.mark.parametrize(
    ("base_url", "fields", "reason"),
    [
        ("http://100.101.102.103/v1", {"tailnet": True, "listenerOwner": "root"}, "loopback"),
        ("http://127.0.0.1:9/v1", {"listenerOwner": ""}, "listenerOwner"),
        ("http://127.0.0.1:9/v1", {"listenerOwner": -1}, "listenerOwner"),
        ("http://127.0.0.1:9/v1", {"listenerOwner": True}, "listenerOwner"),
    ],
)
def test_r_c3_a_bad_listener_owner_disables_discovery_with_its_reason(
    base_url: str, fields: dict[str, object], reason: str
) -> None:
    entry = {
        "id": "p",
        "baseUrl": base_url,
        "credentialFile": "/k",
        "capacityDiscovery": True,
        "models": {"a": "m"},
        **fields,
    }
    config = parse_config(json.dumps({"providers": [entry]}).encode())
    status = config.statuses["p"]
    assert not status.discovery_active
    assert status.reason.startswith("config_invalid:") and reason in status.reason


def test_r_p7_netlink_and_proc_net_tcp_name_the_same_owner_of_a_listener() -> None:
    with NobodyListener() as squatter:
        by_netlink = listeners.read_netlink_table()
        by_proc = listeners.read_proc_tables()
    assert by_netlink is not None and by_proc is not None
    assert by_netlink[("127.0.0.1", squatter.port)] == frozenset({65534})
    assert by_proc[("127.0.0.1", squatter.port)] == frozenset({65534})
