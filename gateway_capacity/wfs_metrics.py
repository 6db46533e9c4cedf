"""wait-for-slot's samples and its metrics mode: one GET of vLLM's gauges (R-W1, R-W2, R-W5).

A sample is a :class:`Load` (gate on it), a :class:`NoAnswer` (counts as no
room; sampling goes on) or a :class:`Fatal` (exit 2 with its one-line
reason). :class:`MetricsSampler` takes one from
``{url}/upstream/{model}/metrics`` (llama-swap's passthrough of vLLM's
Prometheus text), from a ``/metrics`` URL given whole (vLLM itself), or, when
``{url}`` turns out to be a capacity router, from its ``GET /v1/load`` (the
farm's capacity for the model and what the router relays now);
``gateway_capacity.wait_for_slot`` is the loop and the CLI.
"""

from __future__ import annotations

import asyncio
import math
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Final
from urllib.parse import quote, urlsplit

import msgspec

if TYPE_CHECKING:
    import httpx

    from sidecar.credential import Secret

RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
DEFAULT_TIMEOUT_S: Final = 5.0  # the whole of one sample: connect, headers and body
MAX_BODY_BYTES: Final = 4 * 1024 * 1024  # the text parser is slow on huge lines

# --------------------------------------------------------------------------- samples


@dataclass(frozen=True, slots=True)
class Load:
    """What one sample saw: the server's load and the limit to gate on."""

    running: float
    waiting: float
    limit: int

    def has_room(self, need: int) -> bool:
        return self.running + self.waiting + need <= self.limit


@dataclass(frozen=True, slots=True)
class NoAnswer:
    """No usable answer this time (no answer, timeout, 5xx, 429): no room, keep sampling."""

    reason: str


@dataclass(frozen=True, slots=True)
class Unreachable(NoAnswer):
    """The server could not be reached at all (connection refused, no route, unknown
    name): more likely a wrong URL or port than a busy server. No room, like any
    :class:`NoAnswer`, but said as "no answer"; ``--check`` gives up on it at once."""


@dataclass(frozen=True, slots=True)
class Fatal:
    """An answer that sampling again will not change (401, 404, a 3xx, no gauges): exit 2."""

    reason: str


Sample = Load | NoAnswer | Fatal


class MetricsError(ValueError):
    """Metrics text that does not give both gauges as finite, non-negative numbers."""


def parse_load(text: str, model: str | None = None) -> tuple[float, float]:
    """``(running, waiting)`` summed over every label set (one series per vLLM ``engine``);
    with ``model``, only the series whose ``model_name`` is that model.

    Parsed with prometheus_client's reference parser. It is a generator that can
    fail on the last line, so the whole walk is inside the ``try``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float | None] = {RUNNING: None, WAITING: None}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in totals:
                    continue
                if model is not None and sample.labels.get("model_name", model) != model:
                    continue
                value = float(sample.value)
                if not math.isfinite(value) or value < 0:
                    raise MetricsError(f"{sample.name} is {value!r}, not a count")
                totals[sample.name] = (totals[sample.name] or 0.0) + value
    except MetricsError:
        raise
    except Exception as exc:  # the parser raises ValueError, but any failure means the same
        raise MetricsError(f"malformed metrics text ({one_line(str(exc))})") from None
    missing = [name for name, total in totals.items() if total is None]
    if missing:
        served = f" for model_name {model!r}" if model is not None else ""
        raise MetricsError(f"the answer has no {' and no '.join(missing)} gauge{served}")
    running, waiting = totals[RUNNING], totals[WAITING]
    assert running is not None and waiting is not None
    return running, waiting


def is_direct(base_url: str) -> bool:
    """A URL of the metrics themselves (vLLM's ``http://host:8000/metrics``)."""
    return urlsplit(base_url).path.rstrip("/").endswith("/metrics")


def metrics_url(base_url: str, model: str | None) -> str:
    """``{base}/upstream/{model}/metrics``, or a ``.../metrics`` URL as given;
    ValueError with a one-line reason."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("--url must be http://HOST[:PORT][/PATH] or https://...")
    if parts.username is not None or parts.password is not None:
        # never echo it: the part before '@' is a credential
        raise ValueError("--url must not carry credentials; use --key-env or --key-file")
    if parts.query or parts.fragment:
        raise ValueError("--url must not have a query or a fragment")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError("--url has an invalid port") from None
    if is_direct(base_url):
        url = base_url.rstrip("/")
    else:
        if model is None:
            raise ValueError(
                "give --model M with a base URL, or the metrics URL itself "
                "(http://HOST:PORT/metrics)"
            )
        segments = model.split("/")
        if not model or any(seg in ("", ".", "..") for seg in segments):
            raise ValueError("--model must be a model id such as 'workhorse' or 'org/model'")
        # llama-swap routes model ids that contain '/', so the slash stays as it is
        path = quote(model, safe="/-._~:@+")
        url = f"{base_url.rstrip('/')}/upstream/{path}/metrics"
    import httpx

    try:
        httpx.URL(url).host  # noqa: B018 - rejects control characters, bad IDNA names
    except Exception:  # httpx.InvalidURL, idna errors: a usage error, never a traceback
        raise ValueError("--url is not a valid URL (bad characters or host name)") from None
    return url


class MetricsSampler:
    """One GET of ``{url}/upstream/{model}/metrics`` per call (R-W1, R-W2, R-W5).

    ``timeout`` is one deadline for the whole sample (connect, TLS, headers,
    body). Redirects are not followed, proxies and other environment settings
    are ignored, and without a key no ``Authorization`` header is sent.
    """

    def __init__(
        self,
        url: str,
        *,
        limit: int,
        key: Secret | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        ca_file: str | None = None,
        model: str | None = None,
        base: str | None = None,
        limit_given: bool = True,
    ) -> None:
        import httpx

        self.url = url
        self.limit = limit
        self.model = model
        # where a capacity router would answer GET /v1/load (None: not to be tried)
        self._router_load = None if base is None else router_load_url(base)
        self._limit_given = limit_given
        self.router = False  # set once the URL turned out to be a capacity router
        self._key = key
        self.timeout = timeout
        # Built once: loading a CA bundle takes longer than a loopback sample, and
        # must not eat into the sample's deadline.
        self._verify: ssl.SSLContext = (
            ssl.create_default_context(cafile=ca_file)
            if ca_file is not None
            else httpx.create_ssl_context(trust_env=False)
        )

    def __call__(self) -> Sample:
        return asyncio.run(self.sample())

    async def sample(self) -> Sample:
        if self.router:
            return await self._sample_router()
        first = await self._sample_metrics()
        if (
            isinstance(first, Fatal)
            and first.reason.startswith("not found (HTTP 404)")
            and self._router_load is not None
        ):
            routed = await self._sample_router()
            if not isinstance(routed, Fatal) or not routed.reason.startswith(_NOT_ROUTER):
                self.router = True
                self.url = self._router_load
                return routed
        return first

    def _client(self) -> httpx.AsyncClient:
        """No redirects, nothing from the environment, the sample's deadline."""
        import httpx

        return httpx.AsyncClient(
            follow_redirects=False,
            trust_env=False,
            timeout=httpx.Timeout(self.timeout),
            verify=self._verify,
        )

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {
            "Accept": accept,
            # compressed bodies would dodge the size cap until decoded
            "Accept-Encoding": "identity",
            "User-Agent": "gateway-capacity-wait-for-slot",
        }
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key.reveal()}"
        return headers

    async def _sample_router(self) -> Sample:
        """One GET of a capacity router's ``/v1/load``: the farm's capacity for
        the model (at most ``--limit`` when given) and what the router runs."""
        import httpx
        import msgspec

        assert self._router_load is not None and self.model is not None
        try:
            async with (
                asyncio.timeout(self.timeout),
                self._client() as client,
                client.stream("GET", self._router_load, headers=self._headers("*/*")) as response,
            ):
                body = await self._read_capped(response)
        except (TimeoutError, httpx.TimeoutException):
            return NoAnswer(f"no answer within {secs(self.timeout)} s")
        except httpx.HTTPError as exc:
            return NoAnswer(f"no answer ({one_line(str(exc)) or type(exc).__name__})")
        if response.status_code in (401, 403):
            return Fatal(
                f"the capacity router at {self._router_load} refused the key "
                f"(HTTP {response.status_code}); give the router's key with --key-file"
            )
        if response.status_code == 503:
            return NoAnswer("the router has no observation yet (HTTP 503)")
        doc: _LoadDoc | None = None
        if not isinstance(body, Fatal):
            try:
                doc = msgspec.json.decode(body, type=_LoadDoc)
            except msgspec.DecodeError:  # ValidationError is a DecodeError
                doc = None
        if response.status_code != 200 or doc is None or doc.object != "inference_load":
            return Fatal(
                f"{_NOT_ROUTER}: {self.url} answered 404, and {self._router_load} "
                f"(a capacity router's load) answered {response.status_code}; with "
                "llama-swap give --url BASE --model M, with vLLM its /metrics URL, "
                "with a router farm the router's URL (a router with GET /v1/load)"
            )
        for row in doc.models:
            if row.id == self.model:
                limit = row.max_concurrent_requests
                if self._limit_given:
                    limit = min(limit, self.limit)
                return Load(float(row.running), 0.0, limit)
        if not doc.complete:
            return NoAnswer(f"the router's snapshot is incomplete: no row for {self.model}")
        known = ", ".join(row.id for row in doc.models) or "none"
        return Fatal(f"the router serves no model {self.model!r}; known: {known}")

    async def _sample_metrics(self) -> Sample:
        import httpx

        headers = self._headers("text/plain")
        try:
            async with (
                asyncio.timeout(self.timeout),
                self._client() as client,
                client.stream("GET", self.url, headers=headers) as response,
            ):
                early = self._judge_status(response.status_code)
                if early is not None:
                    return early
                body = await self._read_capped(response)
        except (TimeoutError, httpx.TimeoutException):
            return NoAnswer(f"no answer within {secs(self.timeout)} s")
        except httpx.TransportError as exc:
            if _caused_by(exc, ssl.SSLCertVerificationError):
                return Fatal(
                    f"the server's TLS certificate is not trusted ({one_line(str(exc))}); "
                    "give --ca-file PATH for a private CA"
                )
            if isinstance(exc, httpx.ConnectError):
                why = (
                    "connection refused"
                    if _caused_by(exc, ConnectionRefusedError)
                    else one_line(str(exc)) or type(exc).__name__
                )
                return Unreachable(f"cannot connect to {self.url} ({why})")
            return NoAnswer(f"no answer ({one_line(str(exc)) or type(exc).__name__})")
        except httpx.HTTPError as exc:  # a malformed answer (e.g. a body that will not decode)
            return Fatal(f"unusable answer from {self.url}: {type(exc).__name__}")
        if isinstance(body, Fatal):
            return body
        try:
            direct = is_direct(self.url) and self._router_load is None
            running, waiting = parse_load(body.decode("utf-8"), self.model if direct else None)
        except UnicodeDecodeError:
            return Fatal("the metrics answer is not UTF-8 text")
        except MetricsError as exc:
            return Fatal(f"{exc} at {self.url}")
        return Load(running, waiting, self.limit)

    def _judge_status(self, code: int) -> Sample | None:
        if 200 <= code < 300:
            return None
        if 300 <= code < 400:
            return Fatal(
                f"redirect refused (HTTP {code}): redirects are not followed; "
                "point --url at the server itself"
            )
        if code == 401:
            hint = (
                "no key was sent; give --key-env NAME or --key-file PATH"
                if self._key is None
                else "the server did not accept the key"
            )
            return Fatal(f"unauthorized (HTTP 401): {hint}")
        if code == 403:
            return Fatal("forbidden (HTTP 403): the key may not read this model's metrics")
        if code == 404:
            return Fatal(
                f"not found (HTTP 404): {self.url}; check --url and --model (llama-swap: "
                "its base URL; vLLM: its /metrics URL; a router farm: the router's URL "
                "and its key)"
            )
        if code == 429:
            return NoAnswer("busy (HTTP 429)")
        if 400 <= code < 500:
            return Fatal(f"HTTP {code} from {self.url}")
        if 500 <= code < 600:
            return NoAnswer(f"HTTP {code}")
        return Fatal(f"unexpected HTTP status {code} from {self.url}")

    async def _read_capped(self, response: httpx.Response) -> bytes | Fatal:
        too_large = Fatal(f"the metrics answer is larger than {MAX_BODY_BYTES} bytes")
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return too_large
        coding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            # we asked for identity; a compressed body would only be measured after
            # inflating it, so the cap would mean nothing
            return Fatal(
                f"the metrics answer is compressed ({one_line(coding, 40)}); asked for identity"
            )
        from capacity_contract import read_capped

        body = await read_capped(response.aiter_raw(), MAX_BODY_BYTES)
        return too_large if body is None else body


_NOT_ROUTER = "no metrics and no capacity router here"


class _LoadRow(msgspec.Struct):
    id: str
    max_concurrent_requests: Annotated[int, msgspec.Meta(ge=0)]
    running: Annotated[int, msgspec.Meta(ge=0)]


class _LoadDoc(msgspec.Struct):  # capacity_router/app.py farm_load
    object: str
    complete: bool
    models: list[_LoadRow]


def router_load_url(base_url: str) -> str:
    """A router's ``GET /v1/load`` from its base URL (a provider's ``.../v1`` too)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/v1/load"


def secs(value: float) -> str:
    """Seconds as a person reads them: 0.02, 1.5, 12."""
    if value < 1:
        return f"{round(value, 2):g}"
    return f"{round(value, 1):g}" if value < 10 else f"{value:.0f}"


def one_line(text: str, limit: int = 160) -> str:
    """``text`` on one line with its control characters escaped (it may quote the
    server's own words), cut to ``limit``."""
    from capacity_contract import shown

    flat = shown(" ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    for _ in range(10):  # a short chain; a cycle cannot loop forever
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
