"""``gateway-capacity wait-for-slot``: the client-side gate before a fan-out (section 9).

A client counts only its own requests, so before launching several it asks
how busy the server is and waits until ``running + waiting + need <= limit``.

The loop (:func:`wait_for_slot`) knows nothing about where a sample comes
from: it calls a ``sample() -> Sample`` callable. Metrics mode (R-W1..R-W3,
R-W5) samples ``{url}/upstream/{model}/metrics`` with one GET per sample
(:class:`~gateway_capacity.wfs_metrics.MetricsSampler`, in a module of its own);
local mode (R-W4) reads this host's segment
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
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TextIO

from gateway_capacity.common import add_target_options, fail, segment_from_args
from gateway_capacity.exits import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from gateway_capacity.wfs_metrics import (
    DEFAULT_TIMEOUT_S,
    Fatal,
    Load,
    MetricsSampler,
    NoAnswer,
    Sample,
    Unreachable,
    is_direct,
    metrics_url,
    one_line,
    secs,
)
from gateway_config import known_providers
from shm_layout.layout import Source

if TYPE_CHECKING:
    from shm_layout.view import ProviderView
    from sidecar.credential import Secret

DEFAULT_LIMIT: Final = 6  # a policy choice (leave slots for latency-sensitive consumers)
DEFAULT_NEED: Final = 1
DEFAULT_INTERVAL_S: Final = 5.0
DEFAULT_MAX_WAIT_S: Final = 600.0

EXIT_ROOM: Final = EXIT_OK
EXIT_NO_ROOM: Final = EXIT_PROBLEM
EXIT_FATAL: Final = EXIT_USAGE

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True, slots=True)
class TokenLoad(Load):
    """A local sample with the provider's token budget (docs/DESIGN.md section 6c): room
    when the slots allow and ``tokens`` more fit beside those running (no budget in
    force: the slots alone)."""

    tokens_running: int = 0
    tokens: int = 0
    token_limit: int = 0  # 0: none in force

    def has_room(self, need: int) -> bool:
        fits = not self.token_limit or self.tokens_running + self.tokens <= self.token_limit
        return Load.has_room(self, need) and fits


@dataclass(frozen=True, slots=True)
class Result:
    """How a wait ended. ``outcome`` is ``room``, ``no_room``, ``gave_up`` or ``error``."""

    code: int
    outcome: str
    last: Sample
    samples: int
    waited_s: float

    def as_json(self, need: int, limit: int | None = None) -> dict[str, object]:
        """The ``--json`` line; ``limit`` is the limit known without a sample (metrics
        mode's ``--limit``), shown when the last sample has none."""
        load = self.last if isinstance(self.last, Load) else None
        reason = None if isinstance(self.last, Load) else self.last.reason
        from gateway_capacity.schemas import SCHEMA_VERSION

        return {
            "schema_version": SCHEMA_VERSION,
            "outcome": self.outcome,
            "exit_code": self.code,
            "running": load.running if load else None,
            "waiting": load.waiting if load else None,
            "need": need,
            "limit": load.limit if load else limit,
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
            progress(f"{seen}; gave up after {secs(waited)} s")
            return Result(EXIT_NO_ROOM, "gave_up", last, count, waited)
        pause = min(interval, remaining)
        progress(
            f"{seen}; next sample in {secs(pause)} s "
            f"(waited {secs(waited)} s of {secs(max_wait)} s)"
        )
        sleep(pause)


def describe(last: Sample, need: int) -> str:
    if isinstance(last, Load):
        total = last.running + last.waiting + need
        relation, verdict = ("<=", "room") if last.has_room(need) else (">", "no room")
        return (
            f"running {last.running:g} + waiting {last.waiting:g} + need {need} = {total:g} "
            f"{relation} limit {last.limit}" + _tokens_said(last) + f": {verdict}"
        )
    if isinstance(last, Unreachable):
        return f"no answer: {last.reason} (is the URL right?)"
    if isinstance(last, NoAnswer):
        return f"no room: {last.reason}"
    return last.reason


# --------------------------------------------------------------------------- the key
# The key file follows the probe's rules (sidecar/credential.py, R-P7): a regular
# file, not a symlink, mode 600 or stricter, trailing CR/LF/space trimmed.


def _tokens_said(last: Load) -> str:
    if not isinstance(last, TokenLoad) or not last.token_limit:
        return ""
    total = last.tokens_running + last.tokens
    relation = "<=" if total <= last.token_limit else ">"
    return (
        f", tokens running {last.tokens_running} + {last.tokens} = {total} {relation} "
        f"token limit {last.token_limit}"
    )


def key_from_env(name: str) -> Secret:
    """The key in environment variable ``name``, trimmed and checked like a key file."""
    from capacity_contract import bearer_key
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
    return read_credential(path, reader="wait-for-slot")


# --------------------------------------------------------------------------- local mode


def class_load(provider: ProviderView, cls: str) -> Load | str:
    """The provider's load as requests of class ``cls`` see it (docs/classes.md): the
    unused reserves of the higher classes and the class's own cap lower the limit, and
    only the waiters of this class or a higher one are ahead. A string: why not (the
    provider has no such class)."""
    names = [c.name for c in provider.classes]
    if cls not in names:
        return (
            f"provider {provider.id} has no admission class {cls!r} (it has: "
            + (", ".join(names) or "none")
            + ")"
        )
    running, limit = provider.running, provider.effective_limit
    if provider.classes_suspended:
        return Load(float(running), float(provider.waiting), limit)
    k = names.index(cls)
    higher = provider.classes[:k]
    limit -= sum(max(c.reserve - c.running, 0) for c in higher)
    own = provider.classes[k]
    if own.cap is not None:
        limit = min(limit, running + own.cap - own.running)
    ahead = sum(c.waiting for c in provider.classes[: k + 1])
    return Load(float(running), float(ahead), max(limit, 0))


def _sample_local(
    segment: str, provider_id: str, need: int, cls: str | None = None, tokens: int = 0
) -> Sample:
    """One reading of this host's segment (R-W4): gate on the provider's effective limit.

    A ``need`` above the highest limit the provider can reach without a config edit
    (its static limit, or discovery's ceiling: its own ``maxConcurrent``, else 64,
    R-L4) can never fit: that is an error at once, not a wait until ``--max-wait``.
    A limit below ``need`` for now (0 while a legacy generation drains) is a wait.
    """
    from shm_layout import SegmentError, SegmentNotReady
    from shm_layout.view import read_view

    try:
        view = read_view(segment)
    except SegmentNotReady as exc:  # another party is creating it right now
        return NoAnswer(one_line(str(exc)))
    except SegmentError as exc:  # missing, not ours, other major version: one line each
        return Fatal(one_line(str(exc)))
    provider = view.provider(provider_id)
    if provider is None:
        known = known_providers(provider_id, [p.id for p in view.providers])
        return Fatal(f"provider {provider_id!r} is not in segment {segment}{known}")
    ceiling, why = limit_ceiling(
        discovery=provider.capacity_discovery,
        fallback=provider.fallback_limit,
        fallback_source=provider.fallback_source,
    )
    if need > ceiling:
        return Fatal(
            f"--need {need} can never fit: provider {provider_id}'s limit can be at most "
            f"{ceiling} ({why})"
        )
    if cls is not None:
        load = class_load(provider, cls)
        if isinstance(load, str):
            return Fatal(load)
    else:
        load = Load(float(provider.running), float(provider.waiting), provider.effective_limit)
    if not tokens:
        return load
    per, total = provider.request_token_limit, provider.token_limit
    if (per is not None and tokens > per) or (total is not None and tokens > total):
        return Fatal(
            f"--tokens {tokens} can never fit: provider {provider_id}'s workers hold at most "
            f"{per if per is not None and tokens > per else total} tokens "
            + ("a request" if per is not None and tokens > per else "together")
        )
    budget = 0 if total is None or provider.tokens_suspended else total
    return TokenLoad(
        load.running, load.waiting, load.limit, provider.tokens_running, tokens, budget
    )


def limit_ceiling(*, discovery: bool, fallback: int, fallback_source: str) -> tuple[int, str]:
    """The highest effective limit a provider can get without a config edit, and why."""
    from shm_layout.layout import RUNNING_ROOM
    from sidecar.limits import DISCOVERED_CAP

    if not discovery:
        ceiling, why = fallback, "its static limit"
    elif fallback_source == Source.PROVIDER:
        ceiling, why = fallback, "its maxConcurrent caps discovery"
    else:
        ceiling, why = DISCOVERED_CAP, f"discovery is capped at {DISCOVERED_CAP}"
    if ceiling > RUNNING_ROOM:
        return RUNNING_ROOM, f"the segment runs at most {RUNNING_ROOM} at once"
    return ceiling, why


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
            "URL/upstream/MODEL/metrics, a /metrics URL as given, or a capacity router's "
            "/v1/load (one GET per sample, never an inference request); "
            "local mode reads this host's shared segment. Exit 1: no room (--check) or gave "
            "up after --max-wait. Exit 2: 401/403/404/other 4xx, a redirect, an answer "
            "without the gauges, or a usage error. No answer, a timeout, a 5xx or a 429 "
            "count as no room. Advisory only: the gateway's admission stays the hard limit."
        ),
    )
    metrics = parser.add_argument_group("metrics mode (llama-swap, vLLM, or a capacity router)")
    metrics.add_argument(
        "--url",
        metavar="BASE",
        help="llama-swap or capacity router base URL (http://host:8080), or vLLM's "
        "metrics URL itself (http://host:8000/metrics)",
    )
    metrics.add_argument(
        "--model",
        metavar="M",
        help="model id as llama-swap or the router knows it (with a /metrics URL: only "
        "its model_name series)",
    )
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
    local.add_argument(
        "--class", dest="cls", metavar="NAME",
        help="gate on the room this admission class of the provider sees (docs/classes.md)",
    )  # fmt: skip
    local.add_argument(
        "--tokens", type=int, default=0, metavar="N",
        help="and on N tokens fitting the provider's token budget (docs/DESIGN.md 6c)",
    )  # fmt: skip
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
    if args.tokens < 0:
        fail("--tokens must be 0 or more", code=EXIT_FATAL)
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
    if args.cls is not None:
        fail(
            "--class is for local mode (--provider): a server's metrics know no classes", EXIT_FATAL
        )
    if args.tokens:
        fail("--tokens is for local mode (--provider): it reads the segment's budget", EXIT_FATAL)
    if not args.url or not (args.model or is_direct(args.url)):
        fail(
            "give --url BASE and --model M (llama-swap, or a capacity router), --url "
            "http://HOST:PORT/metrics (vLLM itself) or --provider ID (local mode)",
            EXIT_FATAL,
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
    return MetricsSampler(
        url,
        limit=limit,
        key=key,
        timeout=args.timeout,
        ca_file=args.ca_file,
        model=args.model,
        base=None if is_direct(args.url) else args.url,
        limit_given=args.limit is not None,
    )


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
    need: int = args.need
    cls: str | None = args.cls
    tokens: int = args.tokens
    return lambda: _sample_local(segment, provider_id, need, cls, tokens)


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
        given = None if args.provider else (DEFAULT_LIMIT if args.limit is None else args.limit)
        doc = result.as_json(args.need, given)
        if result.code == EXIT_FATAL:
            doc["error"] = describe(result.last, args.need)
        print(json.dumps(doc))
        return result.code
    if result.code == EXIT_FATAL:
        fail(describe(result.last, args.need), code=EXIT_FATAL)
    return result.code
