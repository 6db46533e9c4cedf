"""The capacity probe against real loopback servers that answer well and badly.

Every closed reason of ``sidecar.replica`` is produced by a real server here
(R-P2, R-P4..R-P6, R-K1..R-K4, R-K6). Servers bind 127.0.0.1 or ::1 on port 0.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from probe_servers import RawServer, Request, body_of, fixed, response, snapshot

from sidecar.config import ProviderConfig
from sidecar.probe import MAX_BODY_BYTES, probe_provider, probe_provider_sync, probe_providers
from sidecar.replica import ProviderProbe, ReplicaResult

NOW = 1_800_000_000.25

MakeProvider = Callable[..., ProviderConfig]


def fixed_clock() -> float:
    return NOW


async def _probe(
    handler: Any,
    make_provider: MakeProvider,
    socket_path: str,
    *,
    path: str = "/v1",
    host: str = "127.0.0.1",
    **kwargs: Any,
) -> tuple[ProviderProbe, RawServer]:
    async with RawServer(handler, host=host) as srv:
        provider = make_provider(f"http://{srv.netloc}{path}")
        result = await probe_provider(
            provider, tailscale_socket=socket_path, now_fn=fixed_clock, **kwargs
        )
    return result, srv


def probe_with(
    handler: Any, make_provider: MakeProvider, socket_path: str, **kwargs: Any
) -> tuple[ReplicaResult, RawServer]:
    result, srv = asyncio.run(_probe(handler, make_provider, socket_path, **kwargs))
    assert result.refused is None, result.refused
    assert len(result.replicas) == 1
    return result.replicas[0], srv


Probe = Callable[..., tuple[ReplicaResult, RawServer]]


@pytest.fixture
def probe(make_provider: MakeProvider, no_tailscaled: str) -> Probe:
    """``probe(handler, **options)``: the one replica of a provider on a loopback server
    answering with ``handler``, probed once (no tailscaled); :func:`probe_with`."""
    return lambda handler, **kwargs: probe_with(handler, make_provider, no_tailscaled, **kwargs)


# --- success and the request we send (R-P2) ---------------------------------


def test_r_p2_valid_snapshot_is_ok_and_request_is_exactly_get_capacity_with_bearer(
    probe: Probe, key: str
) -> None:
    doc = snapshot(NOW - 1, [{"id": "workhorse", "max_concurrent_requests": 20}])
    replica, srv = probe(fixed(200, body_of(doc)), path="/v1/")
    assert replica.reason == "ok" and replica.ok
    assert replica.address == "127.0.0.1"
    assert replica.complete is True
    assert replica.observed_at == NOW - 1
    assert replica.models == {"workhorse": 20}
    (req,) = srv.requests
    assert (req.method, req.target) == ("GET", "/v1/capacity")
    assert req.headers["authorization"] == f"Bearer {key}"
    assert req.headers["accept"] == "application/json"
    assert req.headers["accept-encoding"] == "identity"
    assert req.headers["host"] == srv.netloc


def test_r_p2_base_url_without_path_probes_slash_capacity(probe: Probe) -> None:
    replica, srv = probe(fixed(200, body_of(snapshot(NOW))), path="")
    assert replica.ok
    assert srv.requests[0].target == "/capacity"


def test_r_k6_unknown_fields_in_snapshot_and_rows_are_ignored(probe: Probe) -> None:
    doc = snapshot(NOW, [{"id": "workhorse", "max_concurrent_requests": 3, "extra": [1]}])
    doc["future_field"] = {"x": 1}
    replica, _ = probe(fixed(200, body_of(doc)))
    assert replica.ok and replica.models == {"workhorse": 3}


def test_r_k1_incomplete_snapshot_is_ok_with_complete_false(probe: Probe) -> None:
    doc = snapshot(NOW, complete=False)
    replica, _ = probe(fixed(200, body_of(doc)))
    assert replica.ok and replica.complete is False


def test_r_k2_exactly_128_rows_is_valid(probe: Probe) -> None:
    rows = [{"id": f"m{i}", "max_concurrent_requests": i % 4097} for i in range(128)]
    replica, _ = probe(fixed(200, body_of(snapshot(NOW, rows))))
    assert replica.ok and len(replica.models) == 128


# --- status codes ----------------------------------------------------------


def bearer_checking(key: str) -> Any:
    async def handler(req: Request, writer: asyncio.StreamWriter) -> None:
        if req.headers.get("authorization") == f"Bearer {key}":
            writer.write(response(200, body_of(snapshot(NOW))))
        else:
            writer.write(response(401, b'{"error":"unauthorized"}'))
        await writer.drain()

    return handler


def test_r_p2_server_checking_the_bearer_accepts_our_key(probe: Probe, key: str) -> None:
    replica, _ = probe(bearer_checking(key))
    assert replica.ok


def test_r_p2_server_checking_the_bearer_refuses_another_key_as_auth_failed(probe: Probe) -> None:
    replica, _ = probe(bearer_checking("another-key"))
    assert (replica.reason, replica.detail) == ("auth_failed", "http_401")


@pytest.mark.parametrize(
    ("status", "reason", "detail"),
    [
        (401, "auth_failed", "http_401"),
        (403, "auth_failed", "http_403"),
        (404, "no_endpoint", "http_404"),
        (500, "http_error", "http_500"),
        (503, "http_error", "http_503"),
        (429, "http_error", "http_429"),
        (400, "http_error", "http_400"),
    ],
)
def test_r_l5_non_2xx_statuses_map_to_closed_reasons(
    probe: Probe, status: int, reason: str, detail: str
) -> None:
    replica, _ = probe(fixed(status, b'{"error":"x"}'))
    assert (replica.reason, replica.detail) == (reason, detail)
    assert not replica.ok


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_r_p4_redirect_is_refused_and_location_gets_nothing(
    probe: Probe, make_provider: MakeProvider, no_tailscaled: str, status: int
) -> None:
    async def scenario() -> tuple[ProviderProbe, RawServer]:
        async with RawServer(fixed(200, body_of(snapshot(NOW)))) as target:
            location = f"http://{target.netloc}/v1/capacity"
            redirect = fixed(status, b"", {"Location": location})
            result, _ = await _probe(redirect, make_provider, no_tailscaled)
        return result, target

    result, target = asyncio.run(scenario())
    (replica,) = result.replicas
    assert (replica.reason, replica.detail) == ("redirect_refused", f"http_{status}")
    assert target.connections == 0 and target.requests == []


# --- connection failures ------------------------------------------------------


def test_r_l5_closed_port_is_unreachable(make_provider: MakeProvider, no_tailscaled: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    provider = make_provider(f"http://127.0.0.1:{port}/v1")
    result = asyncio.run(probe_provider(provider, tailscale_socket=no_tailscaled))
    (replica,) = result.replicas
    assert replica.reason == "unreachable"
    # the URL with its port, then why: a bare "127.0.0.1 unreachable" would say neither
    assert replica.detail.startswith(f"http://127.0.0.1:{port}/v1/capacity: ConnectError")


def test_r_l5_server_closing_without_answer_is_unreachable(probe: Probe) -> None:
    async def hang_up(_req: Request, writer: asyncio.StreamWriter) -> None:
        writer.close()

    replica, _ = probe(hang_up)
    assert replica.reason == "unreachable"


def test_r_l5_garbage_instead_of_http_is_unreachable(probe: Probe) -> None:
    async def garbage(_req: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()

    replica, _ = probe(garbage)
    assert replica.reason == "unreachable"


# --- body size (R-P6) -------------------------------------------------------------


def test_r_p6_oversize_content_length_is_refused_without_waiting_for_the_body(probe: Probe) -> None:
    async def promise_big(_req: Request, writer: asyncio.StreamWriter) -> None:
        # announces 70000 bytes, sends 10 and then holds the connection open: a probe
        # that read the body would run into the deadline instead of refusing at once
        head = response(200, b"", {"Content-Length": str(MAX_BODY_BYTES + 4464)})
        writer.write(head + b'{"object":')
        await writer.drain()
        await asyncio.sleep(30)

    replica, _ = probe(promise_big)
    assert replica.reason == "too_large"
    assert "Content-Length 70000" in replica.detail


def test_r_p6_endless_chunked_stream_is_cut_after_64_kib(
    make_provider: MakeProvider, no_tailscaled: str
) -> None:
    cap = 50 * 1024 * 1024  # far beyond what loopback socket buffers can absorb
    sent = {"bytes": 0}
    peer_closed = asyncio.Event()

    async def endless(_req: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(response(200, b"", {"Transfer-Encoding": "chunked"}, content_length=False))
        chunk = b"2000\r\n" + b" " * 0x2000 + b"\r\n"
        try:
            while sent["bytes"] < cap:
                writer.write(chunk)
                await writer.drain()
                sent["bytes"] += 0x2000
        except ConnectionError:
            peer_closed.set()

    async def scenario() -> ProviderProbe:
        async with RawServer(endless) as srv:
            provider = make_provider(f"http://{srv.netloc}/v1")
            result = await probe_provider(provider, tailscale_socket=no_tailscaled)
            # the probe closed the connection rather than merely pausing its reads
            await asyncio.wait_for(peer_closed.wait(), 10)
        return result

    (replica,) = asyncio.run(scenario()).replicas
    assert (replica.reason, replica.detail) == ("too_large", f"body over {MAX_BODY_BYTES} bytes")
    assert sent["bytes"] < cap


def _padded_body(size: int) -> bytes:
    body = body_of(snapshot(NOW))
    return body + b" " * (size - len(body))


def test_r_p6_body_of_exactly_64_kib_is_accepted(probe: Probe) -> None:
    replica, _ = probe(fixed(200, _padded_body(MAX_BODY_BYTES)))
    assert replica.ok


def test_r_p6_chunked_body_one_byte_over_64_kib_is_refused(probe: Probe) -> None:
    body = _padded_body(MAX_BODY_BYTES + 1)

    async def chunked(_req: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(response(200, b"", {"Transfer-Encoding": "chunked"}, content_length=False))
        for start in range(0, len(body), 1000):
            part = body[start : start + 1000]
            writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    replica, _ = probe(chunked)
    assert replica.reason == "too_large"


def test_r_p6_compressed_body_is_refused_as_invalid(probe: Probe) -> None:
    replica, _ = probe(fixed(200, b"\x1f\x8b\x08\x00", {"Content-Encoding": "gzip"}))
    assert replica.reason == "invalid"


# --- the contract (R-K1..R-K4) -------------------------------------------------------


def _rows(value: Any) -> list[dict[str, Any]]:
    return [{"id": "workhorse", "max_concurrent_requests": value}]


INVALID_BODIES: dict[str, bytes] = {
    "129 rows": body_of(
        snapshot(NOW, [{"id": f"m{i}", "max_concurrent_requests": 1} for i in range(129)])
    ),
    "duplicate ids": body_of(
        snapshot(
            NOW,
            [
                {"id": "workhorse", "max_concurrent_requests": 1},
                {"id": "workhorse", "max_concurrent_requests": 2},
            ],
        )
    ),
    "count bool": body_of(snapshot(NOW, _rows(True))),
    "count float": body_of(snapshot(NOW, _rows(1.5))),
    "count integral float": b'{"object":"inference_capacity","version":1,"complete":true,'
    b'"observed_at":1800000000.25,"models":[{"id":"workhorse","max_concurrent_requests":20.0}]}',
    "count string": body_of(snapshot(NOW, _rows("20"))),
    "count negative": body_of(snapshot(NOW, _rows(-1))),
    "count 4097": body_of(snapshot(NOW, _rows(4097))),
    "count null": body_of(snapshot(NOW, _rows(None))),
    "row without id": body_of(snapshot(NOW, [{"max_concurrent_requests": 1}])),
    "wrong object": body_of(snapshot(NOW, object="capacity")),
    "wrong version": body_of(snapshot(NOW, version=2)),
    "version as string": body_of(snapshot(NOW, version="1")),
    "complete as string": body_of(snapshot(NOW, complete="yes")),
    "observed_at as string": body_of(snapshot(NOW, observed_at="now")),
    "observed_at infinite": b'{"object":"inference_capacity","version":1,"complete":true,'
    b'"observed_at":1e999,"models":[]}',
    "missing models": body_of(
        {"object": "inference_capacity", "version": 1, "complete": True, "observed_at": NOW}
    ),
    "invalid JSON": b'{"object": "inference_capacity",',
    "empty body": b"",
    "JSON array": b"[]",
}


@pytest.mark.parametrize("case", sorted(INVALID_BODIES))
def test_r_k1_k3_invalid_snapshot_is_invalid(probe: Probe, case: str) -> None:
    replica, _ = probe(fixed(200, INVALID_BODIES[case]))
    assert replica.reason == "invalid", (case, replica)
    assert replica.detail  # says why
    assert replica.models == {}


@pytest.mark.parametrize(
    ("observed_at", "reason"),
    [
        (NOW - 31, "stale"),
        (NOW - 29, "ok"),
        (NOW + 6, "future"),
        (NOW + 4, "ok"),
    ],
)
def test_r_k4_freshness_against_the_sidecar_clock(
    probe: Probe, observed_at: float, reason: str
) -> None:
    replica, _ = probe(fixed(200, body_of(snapshot(observed_at))))
    assert replica.reason == reason
    assert replica.observed_at == observed_at


# --- the one deadline (R-P5) and independence (R-P8) ------------------------------------


async def drip(_req: Request, writer: asyncio.StreamWriter) -> None:
    """Headers at once, then one body byte every half second: each read is quick, so
    per-operation timeouts never fire; only an overall deadline ends it."""
    body = _padded_body(2000)
    writer.write(response(200, b"", {"Content-Length": str(len(body))}))
    await writer.drain()
    for i in range(len(body)):
        writer.write(body[i : i + 1])
        await writer.drain()
        await asyncio.sleep(0.5)


def test_r_p5_dripping_server_ends_at_the_three_second_deadline(probe: Probe) -> None:
    started = time.monotonic()
    replica, srv = probe(drip)
    elapsed = time.monotonic() - started
    assert replica.reason == "timeout"
    assert len(srv.requests) == 1
    assert 2.5 <= elapsed <= 5.0, elapsed


def test_r_p5_server_that_never_answers_times_out(probe: Probe) -> None:
    async def silent(_req: Request, _writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    started = time.monotonic()
    replica, _ = probe(silent)
    assert replica.reason == "timeout"
    assert 2.5 <= time.monotonic() - started <= 5.0


def test_r_p8_slow_providers_are_probed_concurrently(
    make_provider: MakeProvider, no_tailscaled: str
) -> None:
    """Two dripping providers and a good one: all done in about one deadline, not three."""

    async def scenario() -> tuple[dict[str, ProviderProbe], float]:
        async with (
            RawServer(drip) as slow1,
            RawServer(drip) as slow2,
            RawServer(fixed(200, body_of(snapshot(NOW)))) as good,
        ):
            providers = [
                make_provider(f"http://{slow1.netloc}/v1", id="slow1"),
                make_provider(f"http://{slow2.netloc}/v1", id="slow2"),
                make_provider(f"http://{good.netloc}/v1", id="good"),
            ]
            started = time.monotonic()
            probes = await probe_providers(
                providers, tailscale_socket=no_tailscaled, now_fn=fixed_clock
            )
            return dict(probes), time.monotonic() - started

    probes, elapsed = asyncio.run(scenario())
    assert probes["slow1"].replicas[0].reason == "timeout"
    assert probes["slow2"].replicas[0].reason == "timeout"
    assert probes["good"].replicas[0].ok
    assert elapsed < 5.5, elapsed  # sequential would take at least 6 s


def test_r_p5_hung_resolver_cannot_hold_the_deadline_hostage(
    make_provider: MakeProvider, no_tailscaled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real hung DNS server is not available offline, so the blocking resolver call
    itself is made to hang (it runs in a worker thread, as the real one does)."""
    import threading

    release = threading.Event()

    def hung_getaddrinfo(*_args: Any, **_kwargs: Any) -> Any:
        release.wait(20)
        raise socket.gaierror(socket.EAI_AGAIN, "released")

    monkeypatch.setattr(socket, "getaddrinfo", hung_getaddrinfo)
    provider = make_provider("http://router.tailnet-name.ts.net/v1", tailnet=True)

    async def scenario() -> tuple[ProviderProbe, float]:
        started = time.monotonic()
        try:
            result = await probe_provider(provider, tailscale_socket=no_tailscaled)
        finally:
            release.set()
        return result, time.monotonic() - started

    result, elapsed = asyncio.run(scenario())
    assert result.refused is not None and result.refused.startswith("timeout:")
    assert result.replicas == ()
    assert 2.5 <= elapsed <= 5.0, elapsed


# --- IPv6 loopback --------------------------------------------------------------------


def test_r_p1_ipv6_loopback_provider_is_probed_at_its_literal(probe: Probe, key: str) -> None:
    replica, srv = probe(fixed(200, body_of(snapshot(NOW))), host="::1")
    assert replica.ok and replica.address == "::1"
    assert srv.requests[0].headers["host"] == f"[::1]:{srv.port}"
    assert srv.requests[0].headers["authorization"] == f"Bearer {key}"


def test_r_p9_key_is_read_for_every_probe_so_rotation_needs_no_restart(
    make_provider: MakeProvider, no_tailscaled: str, key_file: Any
) -> None:
    async def scenario() -> list[str]:
        async with RawServer(fixed(200, body_of(snapshot(NOW)))) as srv:
            provider = make_provider(f"http://{srv.netloc}/v1")
            await probe_provider(provider, tailscale_socket=no_tailscaled, now_fn=fixed_clock)
            key_file.write_text("rotated-key-2\r\n")
            await probe_provider(provider, tailscale_socket=no_tailscaled, now_fn=fixed_clock)
        return [r.headers["authorization"] for r in srv.requests]

    first, second = asyncio.run(scenario())
    assert second == "Bearer rotated-key-2"
    assert first != second


def test_r_p1_provider_not_opted_in_is_not_probed(
    probe: Probe, make_provider: MakeProvider, no_tailscaled: str
) -> None:
    result, srv = asyncio.run(
        _probe(
            fixed(200, body_of(snapshot(NOW))),
            lambda url: make_provider(url, capacity_discovery=False),
            no_tailscaled,
        )
    )
    assert result.refused == "not_requested"
    assert srv.connections == 0


def test_json_dump_of_results_is_possible_for_the_cli(probe: Probe) -> None:
    replica, _ = probe(fixed(200, body_of(snapshot(NOW))))
    assert json.loads(json.dumps({"reason": replica.reason, "models": replica.models}))


def test_sync_wrapper_probes_from_plain_code(
    make_provider: MakeProvider, no_tailscaled: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = probe_provider_sync(
        make_provider(f"http://127.0.0.1:{port}/v1"), tailscale_socket=no_tailscaled
    )
    assert [r.reason for r in result.replicas] == ["unreachable"]
    refused = probe_provider_sync(make_provider("http://api.example.com/v1"))
    assert refused.refused is not None and refused.refused.startswith("opt_in_refused:")
