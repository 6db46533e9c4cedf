"""A small OpenAI-compatible gateway that admits every completion through gateway-capacity.

    GATEWAY_CONFIG=/etc/gateway/gateway.json GATEWAY_GENERATION=gw-2.0 \\
        gunicorn -k uvicorn.workers.UvicornWorker -w 4 --chdir examples openai_gateway:app

``POST /v1/chat/completions`` is forwarded, streaming (SSE) or not, to
``{baseUrl}/chat/completions`` of one provider of the gateway config, with that
provider's credential (``credentialFile``, read by the product's own credential
code for every request, so a rotated key applies at once; never logged) as
``Authorization: Bearer``. The request's ``model`` may be a gateway alias from
the provider's ``models`` map; it is sent upstream as the upstream id.
``X-Request-Id`` is passed on, and so is the admission grant
(``x-gateway-capacity-grant``: the provider and when the request arrived and was
admitted, from the middleware; nothing secret), so the upstream can check R-A1 exactly.
``GET /v1/models`` lists the aliases and
``GET /healthz`` answers ``ok``: neither takes an admission slot.

Admission is three lines at the bottom of this file: the Starlette app wrapped
in ``handler_shim.asgi.AdmissionMiddleware``. Every handler process and every
generation on the host then shares one running budget and one queue of 32 per
provider; overflow answers 429 and a wait longer than the timeout 503, both
with ``Retry-After``.

Environment (read in each worker process):

- ``GATEWAY_CONFIG``: the gateway's JSON config (required: without it, or with a config
  that cannot be used, the process says why in one line and exits 3, gunicorn's worker
  boot error, so a gunicorn master stops with the reason instead of restarting its
  workers forever).
- ``GATEWAY_PROVIDER``: the provider id to forward to (default: the first
  provider that has a ``baseUrl``).
- ``GATEWAY_GENERATION``: this generation's label (default ``openai-gateway``),
  read when a worker attaches: a gunicorn ``HUP`` whose config sets a new
  value (``raw_env``) relabels the new workers, with or without ``--preload``.
- ``GATEWAY_ADMISSION_TIMEOUT``: seconds a request may wait for a slot (30).
- ``GATEWAY_RETRY_AFTER``: fixes the ``Retry-After`` of refusals (seconds); unset, it is
  the provider's drain estimate (mean hold time x queue ahead / limit, 1..60 s).
- ``GATEWAY_CAPACITY_SEGMENT``: the segment name, when not derived from the config.

``app_without_admission`` is the same gateway without the middleware: what an
older generation that keeps no shared counters looks like (the upgrade drill
runs it as the legacy generation).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway_config import ConfigError, ProviderConfig, known_providers, read_config_file
from handler_shim.asgi import GRANT_HEADER, GRANT_KEY, AdmissionMiddleware, Grant
from sidecar.credential import CredentialError, read_credential

log = logging.getLogger("openai_gateway")

# gunicorn's worker boot error: its master stops with the reason instead of restarting the
# worker (any other exit status, 1 included, is restarted forever).
WORKER_BOOT_ERROR = 3


def _fail(reason: str) -> NoReturn:
    print(f"openai_gateway: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(WORKER_BOOT_ERROR)


CONFIG = os.environ.get("GATEWAY_CONFIG") or _fail("GATEWAY_CONFIG is not set (the gateway config)")
COMPLETIONS = "/v1/chat/completions"
# Completions stream for minutes; connecting must not take long.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0)
# A pooled connection is let go after 1 s idle, before the shortest idle timeout of the
# servers in front of inference (gunicorn's 2 s; uvicorn's, so vLLM's and SGLang's, and
# llama.cpp's are 5 s). Kept longer, a completion already admitted may be sent on a
# connection the server is closing as idle, and fail 502 without reaching it. (The
# connection counts are httpx's defaults.)
UPSTREAM_LIMITS = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=1.0
)


def openai_error(status: int, message: str, kind: str, code: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}},
        status_code=status,
    )


@dataclass(frozen=True)
class Upstream:
    provider: ProviderConfig

    @property
    def url(self) -> str:
        assert self.provider.base_url is not None
        return self.provider.base_url.rstrip("/") + "/chat/completions"


class ConfigCache:
    """The provider entry, re-read when the config file changes (it is never written)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._upstream: Upstream | None = None

    def upstream(self) -> Upstream:
        st = os.stat(self.path)
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp or self._upstream is None:
            self._upstream = Upstream(_pick_provider(self.path))
            self._stamp = stamp
        return self._upstream


def _pick_provider(path: str) -> ProviderConfig:
    config = read_config_file(path)
    wanted = os.environ.get("GATEWAY_PROVIDER")
    for provider in config.providers:
        if (wanted is None and provider.base_url) or provider.id == wanted:
            if not provider.base_url:
                raise ConfigError(f"{path}: provider {provider.id!r} has no baseUrl")
            return provider
    if not wanted:
        raise ConfigError(f"{path}: no provider has a baseUrl")
    known = known_providers(wanted, [p.id for p in config.providers], none="none")
    raise ConfigError(f"{path}: no provider {wanted!r} (GATEWAY_PROVIDER){known}")


def provider_id() -> str:
    """The provider the completions are admitted against: one line and exit when unusable."""
    try:
        return _pick_provider(CONFIG).id
    except (OSError, ConfigError) as exc:
        _fail(str(exc))


def build_app(config_path: str = CONFIG) -> Starlette:
    cache = ConfigCache(config_path)
    client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal client
        # One pool per worker process, made after the fork; no proxies from the environment.
        client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT, limits=UPSTREAM_LIMITS, trust_env=False
        )
        try:
            yield
        finally:
            await client.aclose()

    async def completions(request: Request) -> Response:
        try:
            upstream = cache.upstream()
        except (OSError, ConfigError) as exc:
            log.error("gateway config: %s", exc)
            return openai_error(
                500, "the gateway's config cannot be read", "server_error", "config_error"
            )
        try:
            body: Any = await request.json()
        except ValueError:
            return openai_error(
                400, "the body is not JSON", "invalid_request_error", "invalid_json"
            )
        if not isinstance(body, dict):
            return openai_error(
                400, "the body must be a JSON object", "invalid_request_error", "invalid_json"
            )
        models = upstream.provider.models
        model = body.get("model")
        if models and model in models:
            body["model"] = models[model]
        elif models and model not in models.values():
            return openai_error(
                404,
                f"model {model!r} is not served here",
                "invalid_request_error",
                "model_not_found",
            )
        headers = {"accept": request.headers.get("accept", "application/json")}
        if upstream.provider.credential_file:
            try:
                key = read_credential(upstream.provider.credential_file)
            except CredentialError as exc:  # says which file and why, never the content
                log.error("provider %s: %s", upstream.provider.id, exc)
                return openai_error(
                    500,
                    "the provider's credential cannot be read",
                    "server_error",
                    "credential_error",
                )
            headers["authorization"] = f"Bearer {key.reveal()}"
        request_id = request.headers.get("x-request-id")
        if request_id:
            headers["x-request-id"] = request_id
        grant = request.scope.get(GRANT_KEY)
        if isinstance(grant, Grant):  # when and on which provider it was admitted
            headers[GRANT_HEADER] = grant.header()
        assert client is not None, "lifespan did not run"
        outgoing = client.build_request("POST", upstream.url, json=body, headers=headers)
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.HTTPError as exc:
            log.warning("provider %s unreachable: %s", upstream.provider.id, type(exc).__name__)
            return openai_error(
                502,
                f"the provider did not answer ({type(exc).__name__})",
                "server_error",
                "upstream_unreachable",
            )
        passed = {
            k: v
            for k, v in answer.headers.items()
            if k.lower() in ("content-type", "cache-control", "x-request-id")
        }
        # Streams as it arrives; closed when done, or at once when the client goes away.
        return StreamingResponse(
            answer.aiter_raw(),
            status_code=answer.status_code,
            headers=passed,
            background=BackgroundTask(answer.aclose),
        )

    async def list_models(request: Request) -> Response:
        try:
            upstream = cache.upstream()
        except (OSError, ConfigError):
            return openai_error(
                500, "the gateway's config cannot be read", "server_error", "config_error"
            )
        data = [
            {"id": alias, "object": "model", "owned_by": upstream.provider.id}
            for alias in upstream.provider.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    return Starlette(
        routes=[
            Route(COMPLETIONS, completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


app_without_admission = build_app()

# --- admission: the three lines that wire gateway-capacity in --------------------------
PROVIDER = provider_id()
app = AdmissionMiddleware(
    app_without_admission,
    config=CONFIG,
    generation=lambda: os.environ.get("GATEWAY_GENERATION", "openai-gateway"),
    provider=lambda scope: PROVIDER if scope["path"] == COMPLETIONS else None,
    timeout=float(os.environ.get("GATEWAY_ADMISSION_TIMEOUT", "30")),
    retry_after=int(os.environ["GATEWAY_RETRY_AFTER"])
    if "GATEWAY_RETRY_AFTER" in os.environ
    else None,
)
