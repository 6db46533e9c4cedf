"""``gateway-capacity wait-for-slot``: the client-side gate before a fan-out (section 9).

A client counts only its own requests, so before launching several it asks
how busy the server is and waits until ``running + waiting + need <= limit``.

The loop (:func:`wait_for_slot`) knows nothing about where a sample comes
from: it calls a ``sample() -> Sample`` callable. Metrics mode (R-W1..R-W3,
R-W5) samples ``{url}/upstream/{model}/metrics`` with one GET per sample
(:class:`MetricsSampler`); local mode (R-W4) reads this host's segment
(:func:`_sample_local`). A sample is a :class:`Load` (gate on it), a
:class:`NoAnswer` (counts as no room; sampling goes on) or a :class:`Fatal`
(exit 2 with its one-line reason).

Exit codes: 0 room; 1 no room with ``--check``, or gave up after
``--max-wait``; 2 a fatal answer, a usage error, or (``--check``) a server
that could not be reached at all.

The key is never taken from argv and never printed; a message about
``--key-env`` does not echo the name either, because a key pasted there by
mistake would otherwise end up in a log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TextIO
from urllib.parse import quote, urlsplit

from gateway_capacity.common import add_target_options, fail, segment_from_args
from gateway_capacity.exits import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

if TYPE_CHECKING:
    import httpx

    from sidecar.credential import Secret

RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"

DEFAULT_LIMIT: Final = 6  # a policy choice (leave slots for latency-sensitive consumers)
DEFAULT_NEED: Final = 1
DEFAULT_INTERVAL_S: Final = 5.0
DEFAULT_MAX_WAIT_S: Final = 600.0
DEFAULT_TIMEOUT_S: Final = 5.0  # the whole of one sample: connect, headers and body
MAX_BODY_BYTES: Final = 4 * 1024 * 1024  # the text parser is slow on huge lines

EXIT_ROOM: Final = EXIT_OK
EXIT_NO_ROOM: Final = EXIT_PROBLEM
EXIT_FATAL: Final = EXIT_USAGE

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


def parse_load(text: str) -> tuple[float, float]:
    """``(running, waiting)`` summed over every label set (one series per vLLM ``engine``).

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
                value = float(sample.value)
                if not math.isfinite(value) or value < 0:
                    raise MetricsError(f"{sample.name} is {value!r}, not a count")
                totals[sample.name] = (totals[sample.name] or 0.0) + value
    except MetricsError:
        raise
    except Exception as exc:  # the parser raises ValueError, but any failure means the same
        raise MetricsError(f"malformed metrics text ({_one_line(str(exc))})") from None
    missing = [name for name, total in totals.items() if total is None]
    if missing:
        raise MetricsError(f"the answer has no {' and no '.join(missing)} gauge")
    running, waiting = totals[RUNNING], totals[WAITING]
    assert running is not None and waiting is not None
    return running, waiting


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True, slots=True)
class Result:
    """How a wait ended. ``outcome`` is ``room``, ``no_room``, ``gave_up`` or ``error``."""

    code: int
    outcome: str
    last: Sample
    samples: int
    waited_s: float

    def as_json(self, need: int) -> dict[str, object]:
        load = self.last if isinstance(self.last, Load) else None
        reason = None if isinstance(self.last, Load) else self.last.reason
        return {
            "outcome": self.outcome,
            "exit_code": self.code,
            "running": load.running if load else None,
            "waiting": load.waiting if load else None,
            "need": need,
            "limit": load.limit if load else None,
            "reason": reason,
            "samples": self.samples,
            "waited_s": round(self.waited_s, 3),
        }


def wait_for_slot(
    sample: Callable[[], Sample],
    *,
    need: int,
    interval: float,
    max_wait: float,
    check: bool = False,
    progress: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Result:
    """Sample until ``running + waiting + need <= limit`` (R-W1, R-W4).

    ``check`` takes exactly one sample. Otherwise a sample follows every
    ``interval`` seconds, the last one at ``max_wait``; a sample itself may run
    over by at most its own deadline.
    """
    start = clock()
    deadline = start + max_wait
    count = 0
    while True:
        last = sample()
        count += 1
        waited = clock() - start
        seen = describe(last, need)
        if isinstance(last, Fatal):
            return Result(EXIT_FATAL, "error", last, count, waited)
        if check and isinstance(last, Unreachable):
            # one sample, and it reached nothing: "no room" would send the caller into a
            # retry loop against a typo; say why and stop
            return Result(EXIT_FATAL, "unreachable", last, count, waited)
        if isinstance(last, Load) and last.has_room(need):
            progress(seen)
            return Result(EXIT_ROOM, "room", last, count, waited)
        if check:
            progress(seen)
            return Result(EXIT_NO_ROOM, "no_room", last, count, waited)
        remaining = deadline - clock()
        if remaining <= 0:
            progress(f"{seen}; gave up after {_secs(waited)} s")
            return Result(EXIT_NO_ROOM, "gave_up", last, count, waited)
        pause = min(interval, remaining)
        progress(
            f"{seen}; next sample in {_secs(pause)} s "
            f"(waited {_secs(waited)} s of {_secs(max_wait)} s)"
        )
        sleep(pause)


def describe(last: Sample, need: int) -> str:
    if isinstance(last, Load):
        total = last.running + last.waiting + need
        relation, verdict = ("<=", "room") if last.has_room(need) else (">", "no room")
        return (
            f"running {last.running:g} + waiting {last.waiting:g} + need {need} = {total:g} "
            f"{relation} limit {last.limit}: {verdict}"
        )
    if isinstance(last, Unreachable):
        return f"no answer: {last.reason} (is the URL right?)"
    if isinstance(last, NoAnswer):
        return f"no room: {last.reason}"
    return last.reason


# --------------------------------------------------------------------------- the key
# The key file follows the probe's rules (sidecar/credential.py, R-P7): a regular
# file, not a symlink, mode 600 or stricter, trailing CR/LF/space trimmed.


def key_from_env(name: str) -> Secret:
    """The key in environment variable ``name``, trimmed and checked like a key file."""
    from sidecar.contract import bearer_key
    from sidecar.credential import CredentialError, Secret

    if not _ENV_NAME.match(name):
        raise CredentialError("--key-env takes the NAME of an environment variable, not a key")
    value = os.environ.get(name)
    if value is None:
        raise CredentialError("the environment variable named by --key-env is not set")
    try:
        key = bearer_key(value.encode("utf-8", "surrogateescape"))
    except ValueError as exc:
        raise CredentialError(f"the environment variable named by --key-env {exc}") from None
    return Secret(key.decode("ascii"))


def key_from_file(path: str) -> Secret:
    """The key in ``path`` (or ``systemd-credential:NAME``), read by the probe's reader."""
    from sidecar.credential import SYSTEMD_PREFIX, read_credential

    if not path.startswith(SYSTEMD_PREFIX):
        path = os.path.abspath(path)
    return read_credential(path)


# --------------------------------------------------------------------------- metrics mode


def metrics_url(base_url: str, model: str) -> str:
    """``{base}/upstream/{model}/metrics``, or ValueError with a one-line reason."""
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
    ) -> None:
        import httpx

        self.url = url
        self.limit = limit
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
        import httpx

        headers = {
            "Accept": "text/plain",
            # compressed bodies would dodge the size cap until decoded
            "Accept-Encoding": "identity",
            "User-Agent": "gateway-capacity-wait-for-slot",
        }
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key.reveal()}"
        try:
            async with (
                asyncio.timeout(self.timeout),
                httpx.AsyncClient(
                    follow_redirects=False,
                    trust_env=False,
                    timeout=httpx.Timeout(self.timeout),
                    verify=self._verify,
                ) as client,
                client.stream("GET", self.url, headers=headers) as response,
            ):
                early = self._judge_status(response.status_code)
                if early is not None:
                    return early
                body = await self._read_capped(response)
        except (TimeoutError, httpx.TimeoutException):
            return NoAnswer(f"no answer within {_secs(self.timeout)} s")
        except httpx.TransportError as exc:
            if _caused_by(exc, ssl.SSLCertVerificationError):
                return Fatal(
                    f"the server's TLS certificate is not trusted ({_one_line(str(exc))}); "
                    "give --ca-file PATH for a private CA"
                )
            if isinstance(exc, httpx.ConnectError):
                why = (
                    "connection refused"
                    if _caused_by(exc, ConnectionRefusedError)
                    else _one_line(str(exc)) or type(exc).__name__
                )
                return Unreachable(f"cannot connect to {self.url} ({why})")
            return NoAnswer(f"no answer ({_one_line(str(exc)) or type(exc).__name__})")
        except httpx.HTTPError as exc:  # a malformed answer (e.g. a body that will not decode)
            return Fatal(f"unusable answer from {self.url}: {type(exc).__name__}")
        if isinstance(body, Fatal):
            return body
        try:
            running, waiting = parse_load(body.decode("utf-8"))
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
            return Fatal(f"not found (HTTP 404): {self.url}; check --url and --model")
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
            return Fatal(f"the metrics answer is compressed ({coding}); asked for identity")
        from sidecar.contract import read_capped

        body = await read_capped(response.aiter_raw(), MAX_BODY_BYTES)
        return too_large if body is None else body


# --------------------------------------------------------------------------- local mode


def _sample_local(segment: str, provider_id: str) -> Sample:
    """One reading of this host's segment (R-W4): gate on the provider's effective limit."""
    from shm_layout import SegmentError, SegmentNotReady, read_provider_load

    try:
        load = read_provider_load(segment, provider_id)
    except KeyError:
        return Fatal(f"provider {provider_id!r} is not in segment {segment}")
    except SegmentNotReady as exc:  # another party is creating it right now
        return NoAnswer(_one_line(str(exc)))
    except SegmentError as exc:  # missing, not ours, other major version: one line each
        return Fatal(_one_line(str(exc)))
    return Load(float(load.running), float(load.waiting), load.effective_limit)


# --------------------------------------------------------------------------- CLI


class Progress:
    """One line per sample on stderr, or one line updated in place on a terminal."""

    def __init__(self, stream: TextIO, *, quiet: bool) -> None:
        self._stream = stream
        self._quiet = quiet
        self._tty = stream.isatty()
        self._open = False

    def __call__(self, line: str) -> None:
        if self._quiet:
            return
        if self._tty:
            self._stream.write(f"\r\x1b[Kwait-for-slot: {line}")
            self._open = True
        else:
            self._stream.write(f"wait-for-slot: {line}\n")
        self._stream.flush()

    def finish(self) -> None:
        if self._open:
            self._stream.write("\n")
            self._stream.flush()
            self._open = False


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "wait-for-slot",
        # no abbreviations: "--key" must never be taken for --key-env/--key-file
        allow_abbrev=False,
        help="wait until the server has room for NEED more requests (before a fan-out)",
        description=(
            "Exit 0 once running + waiting + NEED <= LIMIT. Metrics mode samples "
            "URL/upstream/MODEL/metrics (one GET per sample, never an inference request); "
            "local mode reads this host's shared segment. Exit 1: no room (--check) or gave "
            "up after --max-wait. Exit 2: 401/403/404/other 4xx, a redirect, an answer "
            "without the gauges, or a usage error. No answer, a timeout, a 5xx or a 429 "
            "count as no room. Advisory only: the gateway's admission stays the hard limit."
        ),
    )
    metrics = parser.add_argument_group("metrics mode (llama-swap in front of vLLM)")
    metrics.add_argument("--url", metavar="BASE", help="llama-swap base URL, e.g. http://host:8080")
    metrics.add_argument("--model", metavar="M", help="model id as llama-swap knows it")
    metrics.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help=f"slots this client may count on (default {DEFAULT_LIMIT}; metrics mode only)",
    )
    metrics.add_argument(
        "--key-env", metavar="NAME", help="read the bearer key from environment variable NAME"
    )
    metrics.add_argument(
        "--key-file",
        metavar="PATH",
        help="read the bearer key from PATH: a regular file, mode 600, trailing CR/LF tolerated",
    )
    # A key in argv is readable by every user of the host: refuse it, loudly.
    metrics.add_argument(
        "--key", "--api-key", "--token", dest="key_in_argv", nargs="?", const="",
        help=argparse.SUPPRESS,
    )  # fmt: skip
    metrics.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"deadline of one sample, body included (default {DEFAULT_TIMEOUT_S:g})",
    )
    metrics.add_argument(
        "--ca-file", metavar="PATH", help="trust this CA bundle for an https --url"
    )
    local = parser.add_argument_group("local mode (this host's shared segment)")
    local.add_argument("--provider", metavar="ID", help="gate on this provider's effective limit")
    add_target_options(parser)  # --config / --segment, for local mode
    parser.add_argument(
        "--need", type=int, default=DEFAULT_NEED, metavar="N",
        help=f"requests about to be sent (default {DEFAULT_NEED})",
    )  # fmt: skip
    parser.add_argument(
        "--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
        help=f"seconds between samples (default {DEFAULT_INTERVAL_S:g})",
    )  # fmt: skip
    parser.add_argument(
        "--max-wait", type=float, default=DEFAULT_MAX_WAIT_S, metavar="S",
        help=f"give up (exit 1) after this many seconds (default {DEFAULT_MAX_WAIT_S:g})",
    )  # fmt: skip
    parser.add_argument(
        "--check",
        action="store_true",
        help="one sample: exit 0 room, 1 no room, 2 the server could not be reached at all",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    parser.set_defaults(func=run)


def _validate_numbers(args: argparse.Namespace) -> None:
    for option, value in (
        ("--interval", args.interval),
        ("--max-wait", args.max_wait),
        ("--timeout", args.timeout),
    ):
        if not math.isfinite(value):
            fail(f"{option} must be a finite number of seconds", code=EXIT_FATAL)
    if args.need < 1:
        fail("--need must be at least 1", code=EXIT_FATAL)
    if args.interval <= 0:
        fail("--interval must be more than 0 seconds", code=EXIT_FATAL)
    if args.max_wait < 0:
        fail("--max-wait must be 0 or more seconds", code=EXIT_FATAL)
    if args.timeout <= 0:
        fail("--timeout must be more than 0 seconds", code=EXIT_FATAL)
    if args.limit is not None and args.limit < 1:
        fail("--limit must be at least 1", code=EXIT_FATAL)
    # local mode learns its limit from the segment; metrics mode knows it now
    limit = DEFAULT_LIMIT if args.limit is None and not args.provider else args.limit
    if limit is not None and args.need > limit:
        fail(f"--need {args.need} can never fit under --limit {limit}", code=EXIT_FATAL)


def _metrics_sampler(args: argparse.Namespace) -> MetricsSampler:
    if not args.url or not args.model:
        fail(
            "give --url BASE and --model M (metrics mode) or --provider ID (local mode)", EXIT_FATAL
        )
    if args.key_env is not None and args.key_file is not None:
        fail("give --key-env or --key-file, not both", code=EXIT_FATAL)
    try:
        url = metrics_url(args.url, args.model)
    except ValueError as exc:
        fail(str(exc), code=EXIT_FATAL)
    if args.ca_file is not None and not os.path.isfile(args.ca_file):
        fail("--ca-file is not a readable file", code=EXIT_FATAL)
    from sidecar.credential import CredentialError

    key = None
    try:
        if args.key_env is not None:
            key = key_from_env(args.key_env)
        elif args.key_file is not None:
            key = key_from_file(args.key_file)
    except CredentialError as exc:
        fail(str(exc), code=EXIT_FATAL)
    limit = DEFAULT_LIMIT if args.limit is None else args.limit
    return MetricsSampler(url, limit=limit, key=key, timeout=args.timeout, ca_file=args.ca_file)


def _local_sampler(args: argparse.Namespace) -> Callable[[], Sample]:
    for option, value in (
        ("--url", args.url),
        ("--model", args.model),
        ("--limit", args.limit),
        ("--key-env", args.key_env),
        ("--key-file", args.key_file),
        ("--ca-file", args.ca_file),
    ):
        if value is not None:
            fail(
                f"{option} is for metrics mode; local mode (--provider) gates on the "
                "segment's effective limit",
                code=EXIT_FATAL,
            )
    segment = segment_from_args(args)
    provider_id: str = args.provider
    return lambda: _sample_local(segment, provider_id)


def run(args: argparse.Namespace) -> int:
    if args.key_in_argv is not None:
        # never echo the value: it is (or was meant to be) the key
        fail(
            "a key on the command line is refused: every user of this host can read argv; "
            "use --key-env NAME or --key-file PATH",
            code=EXIT_FATAL,
        )
    _validate_numbers(args)
    sample = _local_sampler(args) if args.provider else _metrics_sampler(args)

    progress = Progress(sys.stderr, quiet=args.quiet)
    try:
        result = wait_for_slot(
            sample,
            need=args.need,
            interval=args.interval,
            max_wait=args.max_wait,
            check=args.check,
            progress=progress,
        )
    finally:
        progress.finish()
    if args.json:
        doc = result.as_json(args.need)
        if result.code == EXIT_FATAL:
            doc["error"] = describe(result.last, args.need)
        print(json.dumps(doc))
        return result.code
    if result.code == EXIT_FATAL:
        fail(describe(result.last, args.need), code=EXIT_FATAL)
    return result.code


# --------------------------------------------------------------------------- helpers


def _secs(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.0f}"


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
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
