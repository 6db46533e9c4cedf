"""``capacityShare`` in the gateway config: judged as a whole, refused rather than
silently ignored (local mode would over-admit)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.config import ConfigError, parse_config, redis_url_for_logs


def config(share: Any) -> bytes:
    return json.dumps({"capacityShare": share, "providers": []}).encode()


def test_share_absent_means_local_mode() -> None:
    assert parse_config(b'{"providers": []}').share is None


def test_share_accepts_redis_and_rediss_with_defaults() -> None:
    got = parse_config(config({"redis": "rediss://cache.internal:6380/2", "gateway": "gw-1"}))
    assert got.share is not None
    assert (got.share.redis, got.share.gateway, got.share.lease, got.share.floor) == (
        "rediss://cache.internal:6380/2",
        "gw-1",
        10.0,
        1,
    )


@pytest.mark.parametrize(
    ("share", "why"),
    [
        ({"redis": "redis://:hunter2@h/0", "gateway": "a"}, "no password in the URL"),
        ({"redis": "redis://user@h/0", "gateway": "a"}, "no password in the URL"),
        ({"redis": "redis://h/0?password=hunter2", "gateway": "a"}, "use credentialFile"),
        ({"redis": "redis://h/0?pass%77ord=hunter2", "gateway": "a"}, "use credentialFile"),
        ({"redis": "redis://h/0;p?password=hunter2", "gateway": "a"}, "use credentialFile"),
        ({"redis": "redis://h/0?username=hunter2", "gateway": "a"}, "use credentialFile"),
        (
            {
                "redis": "redis://h/0?username=u&password=hunter2",
                "gateway": "a",
                "credentialFile": "/p",
            },
            "use credentialFile",
        ),
        (
            {"redis": "redis://u@h/0?password=hunter2", "gateway": "a", "credentialFile": "/p"},
            "use credentialFile",
        ),
        (
            {"redis": "rediss://h/0?ssl_password=hunter2", "gateway": "a", "credentialFile": "/p"},
            "use credentialFile",
        ),
        ({"redis": "redis://h/0?Password=hunter2", "gateway": "a"}, "use credentialFile"),
        (
            {"redis": "redis://u%3Ahunter2@h/0", "gateway": "a", "credentialFile": "/p"},
            "no password in the URL",
        ),
        (
            {"redis": "redis://h/0?username=u:hunter2", "gateway": "a", "credentialFile": "/p"},
            "no password in the URL",
        ),
        ({"redis": "redis://h/0?hunter2", "gateway": "a"}, "use credentialFile"),
        ({"redis": "redis://h/0?db=0&hunter2=1", "gateway": "a"}, "use credentialFile"),
        ({"redis": "redis://h/0?socket_connect_timeout=60", "gateway": "a"}, "own Redis"),
        ({"redis": "redis://h/0?retry_on_timeout=yes", "gateway": "a"}, "own Redis"),
        ({"redis": "redis://h/0?timeout=3", "gateway": "a"}, "own Redis"),
        ({"redis": "redis://h/0?ssl_min_version=2", "gateway": "a"}, "needs a rediss://"),
        ({"redis": "redis://h/0?protocol=7", "gateway": "a"}, "protocol must be"),
        ({"redis": "redis://h/0?max_connections=-1", "gateway": "a"}, "max_connections"),
        ({"redis": " redis://h/0", "gateway": "a"}, "schemes"),
        ({"redis": "http://h/0", "gateway": "a"}, "redis:// or rediss://"),
        ({"redis": "redis:///0", "gateway": "a"}, "names no host"),
        ({"redis": "redis://h:99999/0", "gateway": "a"}, "not a URL"),
        ({"redis": "redis://h/0", "gateway": "a b"}, "gateway"),
        ({"redis": "redis://h/0", "gateway": "a", "lease": 0.5}, "lease"),
        ({"redis": "redis://h/0", "gateway": "a", "floor": -1}, "floor"),
        ({"redis": "redis://h/0", "gateway": "a", "credentialFile": "pw.txt"}, "absolute"),
        ({"gateway": "a"}, "redis"),
        ("redis://h/0", "capacityShare"),
    ],
)
def test_share_refuses_what_it_cannot_use(share: Any, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config(share))
    assert "capacityShare" in str(err.value) and why in str(err.value)
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize(
    ("outage", "why"),
    [
        ({"outage": "keep"}, "outage keep needs gateways"),
        ({"gateways": 0}, "gateways: expected `int` >= 1"),
        ({"gateways": 3, "keepPart": 0}, "keepPart: expected `float` > 0.0"),
        ({"gateways": 3, "keepPart": 1}, "keepPart: expected `float` < 1.0"),
        ({"gateways": 3, "outage": "serve"}, "outage: invalid enum value"),
    ],
)
def test_share_refuses_an_outage_rule_it_cannot_keep(outage: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_config(config({"redis": "redis://h/0", "gateway": "a", **outage}))


def test_share_keeps_a_part_through_an_outage_once_gateways_are_declared() -> None:
    """The default once ``gateways`` is declared keeps a part; without it (every config
    written before the rule) a gateway holds 0, as before."""
    from sidecar.config import outage_keeps, share_outage_rule

    def rule(**outage: Any) -> tuple[bool, str]:
        got = parse_config(config({"redis": "redis://h/0", "gateway": "a", **outage})).share
        assert got is not None
        return outage_keeps(got), share_outage_rule(got)

    assert rule() == (False, "")
    assert rule(gateways=3) == (True, "3:500")
    assert rule(gateways=3, keepPart=0.25) == (True, "3:250")
    assert rule(gateways=3, outage="hold") == (False, "3:0")


def test_share_a_user_name_goes_with_a_credential_file() -> None:
    got = parse_config(
        config({"redis": "rediss://gw@h/0", "gateway": "a", "credentialFile": "/etc/pw"})
    )
    assert got.share is not None and got.share.credential_file == "/etc/pw"


def test_share_takes_plain_options_and_a_user_name_in_the_query() -> None:
    for url, cred in (
        ("redis://h/0?db=2&protocol=3&socket_keepalive=true", None),
        ("rediss://h/0?ssl_ca_certs=/etc/ca.pem", None),
        ("rediss://h/0?username=gw", "/etc/pw"),
        ("redis://127.0.0.1/0?username=gw", "/etc/pw"),
    ):
        share = {"redis": url, "gateway": "a", "credentialFile": cred}
        got = parse_config(config({k: v for k, v in share.items() if v is not None}))
        assert got.share is not None and got.share.redis == url


@pytest.mark.parametrize(
    ("share", "why"),
    [
        (
            {"redis": "redis://cache.internal/0", "credentialFile": "/etc/pw"},
            "goes only over TLS",
        ),
        (
            {"redis": "rediss://cache.internal/0?ssl_cert_reqs=none", "credentialFile": "/p"},
            "must verify the certificate",
        ),
        ({"redis": "redis://cache.internal/0", "listenerOwner": "redis"}, "loopback Redis only"),
        ({"gateway": "a"}, "one of the two"),
        (
            {"redis": "redis://127.0.0.1/0", "sentinel": {"master": "m", "addresses": ["h:1"]}},
            "one of the two",
        ),
        ({"sentinel": {"master": "m", "addresses": ["host"]}}, "not host:port"),
        ({"sentinel": {"master": "m", "addresses": ["h:1/x"]}}, "not host:port"),
        ({"sentinel": {"master": "m", "addresses": []}}, "addresses"),
        (
            {"sentinel": {"master": "m", "addresses": ["10.0.0.5:26379"]}, "credentialFile": "/p"},
            "without TLS",
        ),
        (
            {
                "sentinel": {
                    "master": "m",
                    "addresses": ["10.0.0.5:26379"],
                    "credentialFile": "/p",
                }
            },
            "without TLS",
        ),
    ],
)
def test_share_sends_a_redis_password_only_where_no_one_else_reads_it(
    share: dict[str, Any], why: str
) -> None:
    """Off this host a password goes only over verified TLS; a Sentinel set (no TLS here)
    gets one only on loopback; ``listenerOwner`` is a loopback rule."""
    with pytest.raises(ConfigError) as err:
        parse_config(config({"gateway": "a", **share}))
    assert why in str(err.value)


def test_share_takes_a_sentinel_set_on_loopback_with_credentials_from_files() -> None:
    sentinel = {
        "master": "gwcap",
        "addresses": ["127.0.0.1:26379", "[::1]:26380", "localhost:26381"],
        "credentialFile": "/etc/gateway-capacity/sentinel.password",
    }
    got = parse_config(config({"sentinel": sentinel, "gateway": "a", "credentialFile": "/etc/pw"}))
    assert got.share is not None and got.share.redis is None
    assert got.share.sentinel is not None and got.share.sentinel.master == "gwcap"
    assert got.share.sentinel.credential_file == "/etc/gateway-capacity/sentinel.password"


def test_share_urls_in_messages_lose_their_user_part() -> None:
    assert redis_url_for_logs("rediss://gw:secret@h:6380/1") == "rediss://h:6380/1"


def test_share_a_handler_that_creates_the_segment_stores_0_as_a_discovery_providers_fallback(
    tmp_path: Any,
) -> None:
    """Before any sidecar ran, a handler's own reading of the config: in share mode a
    provider with discovery runs on 0, never its static limit (docs/share.md)."""
    from handler_shim.entries import providers_from_config

    path = tmp_path / "gateway.json"
    path.write_text(
        json.dumps(
            {
                "maxConcurrent": 8,
                "capacityShare": {"redis": "redis://127.0.0.1:1/0", "gateway": "gw-1"},
                "providers": [
                    {"id": "shared", "baseUrl": "http://127.0.0.1:1/v1", "capacityDiscovery": True},
                    {"id": "static", "baseUrl": "http://127.0.0.1:1/v1", "maxConcurrent": 3},
                ],
            }
        )
    )
    got = {e.provider_id: (e.fallback, e.fallback_source) for e in providers_from_config(path)}
    assert got == {"shared": (0, "share"), "static": (3, "provider")}


def test_share_a_refused_gateway_name_shows_in_the_metrics() -> None:
    from prometheus_client import generate_latest

    from sidecar.metrics import SidecarMetrics

    metrics = SidecarMetrics()
    metrics.share_call("p1", "duplicate")
    metrics.share_refused()
    text = generate_latest(metrics.registry).decode()
    assert "gateway_capacity_share_gateway_refused 1.0" in text
    assert 'gateway_capacity_share_calls_total{provider="p1",result="duplicate"} 1.0' in text


def test_share_the_outage_part_and_keeping_it_show_in_the_metrics() -> None:
    from prometheus_client import generate_latest

    from sidecar.metrics import SidecarMetrics

    metrics = SidecarMetrics()
    metrics.share_outage("p1", 3, False)
    text = generate_latest(metrics.registry).decode()
    assert 'gateway_capacity_share_outage_part{provider="p1"} 3.0' in text
    assert 'gateway_capacity_share_outage_keeping{provider="p1"} 0.0' in text
    metrics.share_outage("p1", 3, True)
    metrics.share_call("p1", "crowded")
    text = generate_latest(metrics.registry).decode()
    assert 'gateway_capacity_share_outage_keeping{provider="p1"} 1.0' in text
    assert 'gateway_capacity_share_calls_total{provider="p1",result="crowded"} 1.0' in text
