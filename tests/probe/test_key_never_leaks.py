"""R-P7: the key appears in no log line, error, reason, detail or repr of any failing probe.

Every failing case runs with the root logger at DEBUG; several servers echo the
Authorization header back (in a body, a Location, a model id) to tempt a leak.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from probe_servers import RawServer, Request, body_of, fixed, response, snapshot

from sidecar.config import ProviderConfig
from sidecar.credential import CredentialError, read_credential
from sidecar.probe import probe_provider
from sidecar.replica import ProviderProbe

NOW = 1_800_000_000.0


def _bearer(req: Request) -> str:
    return req.headers.get("authorization", "").removeprefix("Bearer ")


def echo_status(status: int) -> Any:
    async def handler(req: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(response(status, json.dumps({"you_sent": _bearer(req)}).encode()))
        await writer.drain()

    return handler


async def echo_redirect(req: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(response(302, b"", {"Location": f"http://127.0.0.1:1/?k={_bearer(req)}"}))
    await writer.drain()


async def echo_duplicate_model(req: Request, writer: asyncio.StreamWriter) -> None:
    rows = [{"id": _bearer(req), "max_concurrent_requests": 1}] * 2
    writer.write(response(200, body_of(snapshot(NOW, rows))))
    await writer.drain()


async def echo_model_id(req: Request, writer: asyncio.StreamWriter) -> None:
    rows = [{"id": _bearer(req), "max_concurrent_requests": 1}]
    writer.write(response(200, body_of(snapshot(NOW, rows))))
    await writer.drain()


async def echo_bad_type(req: Request, writer: asyncio.StreamWriter) -> None:
    rows = [{"id": "workhorse", "max_concurrent_requests": _bearer(req)}]
    writer.write(response(200, body_of(snapshot(NOW, rows))))
    await writer.drain()


async def echo_invalid_json(req: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(response(200, f'{{"object": "{_bearer(req)}" "x"'.encode()))
    await writer.drain()


async def echo_huge(req: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(response(200, _bearer(req).encode() * 5000))
    await writer.drain()


async def silent(_req: Request, _writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(10)


HANDLERS: dict[str, Any] = {
    "401 echo": echo_status(401),
    "403 echo": echo_status(403),
    "404 echo": echo_status(404),
    "500 echo": echo_status(500),
    "redirect echo": echo_redirect,
    "duplicate model id echo": echo_duplicate_model,
    "model id echo": echo_model_id,
    "bad count echo": echo_bad_type,
    "invalid JSON echo": echo_invalid_json,
    "too large echo": echo_huge,
    "timeout": silent,
}


def test_r_p7_key_appears_in_no_log_error_or_repr_of_any_failing_case(
    make_provider: Callable[..., ProviderConfig],
    key: str,
    key_file: Path,
    no_tailscaled: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []

    def record(result: ProviderProbe) -> None:
        texts.extend([repr(result), str(result.refused)])
        for r in result.replicas:
            texts.extend([repr(r), r.detail, r.reason, *r.models])

    async def scenario() -> None:
        for name, handler in HANDLERS.items():
            async with RawServer(handler) as srv:
                provider = make_provider(f"http://{srv.netloc}/v1", id=name[:60])
                result = await probe_provider(
                    provider, tailscale_socket=no_tailscaled, now_fn=lambda: NOW, deadline_s=0.5
                )
            assert srv.requests and _bearer(srv.requests[0]) == key  # the server had it
            assert not all(r.ok for r in result.replicas) or name == "model id echo", name
            record(result)
        # https spoken to a plain server, and a closed port
        async with RawServer(fixed(200, b"")) as srv:
            record(await probe_provider(make_provider(f"https://{srv.netloc}/v1"), deadline_s=0.5))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        record(await probe_provider(make_provider(f"http://127.0.0.1:{port}/v1"), deadline_s=0.5))

    asyncio.run(scenario())

    # unusable key files that contain the key
    for content, mode in (
        (key + " trailing-part", 0o600),
        (key + "\x00", 0o600),
        (key, 0o644),
        (key * 200, 0o600),
    ):
        key_file.write_text(content)
        key_file.chmod(mode)
        with pytest.raises(CredentialError) as info:
            read_credential(str(key_file))
        texts.extend([str(info.value), repr(info.value)])
        result = asyncio.run(
            probe_provider(make_provider("http://127.0.0.1:9/v1"), tailscale_socket=no_tailscaled)
        )
        assert result.refused is not None and result.refused.startswith("credential_error:")
        record(result)

    out, err = capsys.readouterr()
    texts.extend([caplog.text, out, err])
    assert len(texts) > 40
    leaks = [t for t in texts if key in t]
    assert leaks == []
