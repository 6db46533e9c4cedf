"""``gateway-capacity router``: serve the reference capacity router, drain and restore workers.

Layout: ``router`` takes an action, so serving and the admin calls never share
options::

    gateway-capacity router serve   --workers FILE --key-file PATH [--listen HOST:PORT] [--poll S]
    gateway-capacity router fence   WORKER --key-file PATH [--url URL] [--json]
    gateway-capacity router unfence WORKER --key-file PATH [--url URL] [--json]
    gateway-capacity router show    --key-file PATH [--url URL] [--json]
    gateway-capacity router check   --workers FILE
    gateway-capacity router simworker --slots N [--port P] [--host 127.0.0.1|::1]
                                      [--shape KIND] [--api-key-file PATH]

The key is only ever read from the key file: never an argument, never printed.
``fence``/``unfence``/``show`` talk to a router on this host (loopback URL).
Exit codes: 0 done; 1 the router refused (unknown worker, fenced in the
registry file, wrong key) or stopped unexpectedly; 2 usage, key file,
registry or connection problems.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import re
import sys
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote, urlsplit

from capacity_router.kinds import SHAPES as SIM_SHAPES
from capacity_router.kinds import SIM_SERVES as _SIM_SERVES
from gateway_capacity.common import fail, require_router_extra
from gateway_capacity.exits import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from gateway_capacity.logs import add_log_options
from gateway_capacity.schemas import SCHEMA_VERSION

if TYPE_CHECKING:
    from capacity_router.pinning import Route
    from capacity_router.registry import Worker

DEFAULT_PORT = 8731
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
_ADMIN_TIMEOUT_S = 30.0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "router",
        help="reference capacity router (serve, fence, unfence, show, check, simworker)",
        description="The reference producer of the capacity contract: sums the slots of "
        "distinct healthy, registered, unfenced workers and serves GET /v1/capacity.",
    )
    parser.set_defaults(func=run)
    actions = parser.add_subparsers(dest="router_action", metavar="ACTION", required=True)

    serve = actions.add_parser(
        "serve",
        help="serve GET /v1/capacity, relay the OpenAI-compatible paths to the workers "
        "(and the loopback admin endpoint)",
    )
    serve.add_argument("--workers", required=True, metavar="FILE", help="worker registry (JSON)")
    serve.add_argument(
        "--key-file",
        required=True,
        metavar="PATH",
        help="bearer key clients must send, for capacity and relayed requests alike "
        "(owner-only file)",
    )
    serve.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address to serve on (default {DEFAULT_LISTEN}; [::1]:PORT for IPv6; "
        "port 0 picks a free one)",
    )
    serve.add_argument(
        "--poll",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="seconds between observations (default 1)",
    )
    serve.add_argument(
        "--poll-timeout",
        type=_positive_float,
        default=2.0,
        metavar="S",
        help="deadline for one worker's poll (default 2)",
    )
    add_log_options(serve)

    for action, text in (
        ("fence", "drain a worker: its slots leave the next observation (run at once)"),
        ("unfence", "restore a worker drained with fence"),
    ):
        sub = actions.add_parser(action, help=text, description=text)
        sub.add_argument("worker", metavar="WORKER", help="worker id from the registry")
        _add_client_options(sub)

    show = actions.add_parser("show", help="print the router's current snapshot")
    _add_client_options(show)

    text = (
        "check a worker registry as serve would read it, without serving: refusals "
        "(exit 1), the largest snapshot it can make, and workers that resolve to one "
        "socket address (a warning)"
    )
    check = actions.add_parser("check", help=text, description=text)
    check.add_argument("--workers", required=True, metavar="FILE", help="worker registry (JSON)")

    text = (
        "serve a simulated inference worker on loopback, in the shape of a real server "
        "(default llama-server: GET /props, GET /health)"
    )
    simworker = actions.add_parser("simworker", help=text, description=text)
    simworker.add_argument(
        "--slots", type=_slot_count, required=True, metavar="N", help="its total_slots"
    )
    simworker.add_argument(
        "--port", type=_port, default=0, metavar="P", help="port (default 0: a free one)"
    )
    simworker.add_argument(
        "--host",
        default="127.0.0.1",
        choices=("127.0.0.1", "::1"),
        help="loopback address to serve on (default 127.0.0.1)",
    )
    simworker.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the model it serves (listed on GET /v1/models, so the router checks the "
        "registry's ids against it; a llama-server shape without --model lists none)",
    )
    simworker.add_argument(
        "--shape",
        default="llama-server",
        choices=SIM_SHAPES,
        help="which server it answers as (default llama-server); see docs/router.md",
    )
    simworker.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="require this key (Authorization: Bearer) on every path but the health "
        "check, as llama-server --api-key does; owner-only file, never an argument",
    )
    simworker.add_argument(
        "--openai",
        action="store_true",
        help="also a fake OpenAI-compatible upstream: POST /v1/chat/completions (streaming "
        "or not, at most --slots at once), GET /v1/models, and llama-swap's vLLM gauges on "
        "GET /metrics and /upstream/MODEL/metrics (for wait-for-slot)",
    )
    simworker.add_argument(
        "--delay",
        type=_delay,
        default=0.5,
        metavar="S",
        help="with --openai: seconds one completion takes (default 0.5)",
    )


def _add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        metavar="URL",
        help=f"the router on this host (default {DEFAULT_URL})",
    )
    parser.add_argument("--key-file", required=True, metavar="PATH", help="the router's key file")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _slot_count(text: str) -> int:
    from capacity_contract import MAX_SLOTS

    if not text.isdigit() or int(text) > MAX_SLOTS:
        raise argparse.ArgumentTypeError(f"must be an integer 0..{MAX_SLOTS}: {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535: {text!r}")
    return int(text)


def _delay(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 3600.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be seconds, 0..3600: {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    action: str = args.router_action
    if action == "serve":
        return _serve(args)
    if action == "simworker":
        return _simworker(args)
    if action == "check":
        return _check(args)
    return _client(args, action)


def _check(args: argparse.Namespace) -> int:
    from capacity_contract import MAX_SNAPSHOT_BYTES, shown, worst_case_snapshot_bytes
    from capacity_router.registry import RegistryError, RegistryWatcher
    from capacity_router.sockets import shared_sockets

    try:
        registry = RegistryWatcher(args.workers).current
    except RegistryError as exc:
        why = shown(exc)
        named = why if str(args.workers) in why else f"registry {shown(args.workers)}: {why}"
        fail(f"{named} (refused: serve would not start on it)", EXIT_PROBLEM)
    models = sorted({m for w in registry.workers for m in w.models})
    print(
        f"registry {shown(args.workers)}: {len(registry.workers)} workers, {len(models)} "
        f"model ids; a snapshot of at most {worst_case_snapshot_bytes(models)} bytes "
        f"(the contract allows {MAX_SNAPSHOT_BYTES})"
    )
    for w in registry.workers:
        slots = w.slots.source or "fixed"
        if w.slots.fixed is not None:
            slots += f", fixed {w.slots.fixed}"
        line = f"  worker {shown(w.id)}: {', '.join(map(shown, w.urls))}; models "
        line += f"{', '.join(map(shown, w.models))}; slots from {slots}"
        if w.key_file is not None:
            line += "; with its own key file"
        if w.fenced:
            line += "; FENCED in the registry file (counts 0)"
        print(line)
    print(f"model ids: {', '.join(map(shown, models)) or '(none)'}")
    for warning in shared_sockets(registry.workers):
        print(f"warning: {shown(warning)}")
    for worker in registry.workers:
        kind = worker.slots.server_kind
        where = f"tokens from {kind.tokens}" if kind.tokens else "slots only (no token capacity)"
        print(f"  {shown(worker.id)} ({kind.name}): {where}")
    # where each URL may be contacted, as the router checks it before every poll and
    # every new relay connection: a loopback listener's owner, a tailnet peer
    for worker, url, route in asyncio.run(_routes(registry.workers)):
        if route.refused is not None:
            print(
                f"warning: worker {shown(worker.id)}: {shown(url)} not contacted: "
                f"{shown(route.refused)}"
            )
        elif route.unresolved is not None:
            print(f"warning: worker {shown(worker.id)}: {shown(route.unresolved)}")
    return EXIT_OK


async def _routes(workers: Sequence[Worker]) -> list[tuple[Worker, str, Route]]:
    """Every worker URL's route, checked at once."""
    from capacity_router.pinning import Route, route_of

    async def one(worker: Worker, url: str) -> tuple[Worker, str, Route]:
        try:
            async with asyncio.timeout(5.0):
                route = await route_of(url, worker.listener_owner, worker.tailnet_check)
        except TimeoutError:
            route = Route(unresolved=f"{url}: checking its address took over 5 s")
        return worker, url, route

    return list(await asyncio.gather(*(one(w, u) for w in workers for u in w.urls)))


# -- serve ------------------------------------------------------------------


def _parse_listen(text: str) -> tuple[str, int]:
    from capacity_contract.addresses import parse_host_port

    try:
        return parse_host_port(text)
    except ValueError as exc:
        fail(f"--listen {exc}", code=EXIT_USAGE)


def _stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT (Ctrl-C) set: a server's cue to stop cleanly."""
    import signal

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def _serve(args: argparse.Namespace) -> int:
    require_router_extra("the reference router")
    from capacity_router import KeyFileError, RegistryError, RouterServer
    from gateway_capacity.logs import setup_logging

    setup_logging(args.log_format, args.log_level, prefix="router: ")
    host, port = _parse_listen(args.listen)
    server = RouterServer(
        args.workers,
        args.key_file,
        host=host,
        port=port,
        poll_interval=args.poll,
        poll_timeout=args.poll_timeout,
    )
    stop = _stop_on_signals()
    try:
        server.start()
    except RegistryError as exc:
        why = str(exc)  # says which file, as an error about a key file does
        fail(why if args.workers in why else f"registry {args.workers}: {why}", code=EXIT_USAGE)
    except KeyFileError as exc:
        fail(str(exc), code=EXIT_USAGE)
    except OSError as exc:
        fail(f"cannot listen on {args.listen}: {exc.strerror or exc}", code=EXIT_USAGE)
    print(f"serving {server.url}/v1/capacity", flush=True)
    try:
        while not stop.wait(0.5):
            if not server.running:
                print("gateway-capacity: router stopped unexpectedly", file=sys.stderr)
                return EXIT_PROBLEM
    finally:
        server.stop()
    return EXIT_OK


def _simworker(args: argparse.Namespace) -> int:
    """A stand-in worker for trying the router from the shell; stops on SIGTERM or Ctrl-C."""
    from capacity_router import KeyFileError, SimWorker, read_key_file

    api_key: str | None = None
    if args.api_key_file is not None:
        try:
            api_key = read_key_file(args.api_key_file).decode("ascii")
        except KeyFileError as exc:
            fail(str(exc), code=EXIT_USAGE)
    worker = SimWorker(
        slots=args.slots,
        host=args.host,
        port=args.port,
        model=args.model,
        openai=args.openai,
        delay=args.delay,
        shape=args.shape,
        api_key=api_key,
    )
    stop = _stop_on_signals()
    try:
        worker.start()
    except OSError as exc:
        where = f"[{args.host}]" if ":" in args.host else args.host
        fail(f"cannot listen on {where}:{args.port}: {exc.strerror or exc}", code=EXIT_USAGE)
    served = _SIM_SERVES[args.shape]
    if api_key is not None:
        served += " (bearer key required but on the health check)"
    if args.openai:
        served += (
            f", POST /v1/chat/completions ({args.delay:g} s each), GET /v1/models, "
            f"GET /metrics, GET /upstream/{args.model}/metrics"
        )
    if args.shape != "llama-server":
        served = f"as {args.shape}: {served}"
    print(f"simulated worker on {worker.url} ({args.slots} slots): {served}", flush=True)
    try:
        stop.wait()
    finally:
        worker.stop()
    return EXIT_OK


# -- fence / unfence / show ---------------------------------------------------


def _loopback_base(url: str) -> str:
    """The router's base URL, refused unless it is on this host (the key goes there)."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a bad port
    except ValueError as exc:
        fail(f"--url {url!r}: {exc}", code=EXIT_USAGE)
    host = parts.hostname or ""
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if parts.scheme not in ("http", "https") or not loopback:
        fail(
            f"--url must be an http(s) URL of a router on this host (loopback), not {url!r}",
            code=EXIT_USAGE,
        )
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        fail("--url must not carry credentials, a query or a fragment", code=EXIT_USAGE)
    return url.rstrip("/")


def _client(args: argparse.Namespace, action: str) -> int:
    import httpx
    import msgspec

    from capacity_contract import MAX_SNAPSHOT_BYTES, ContractError, decode_snapshot, shown
    from capacity_router import KeyFileError, read_key_file
    from capacity_router.registry import WORKER_ID_PATTERN

    base = _loopback_base(args.url)
    if action == "show":
        method, target = "GET", f"{base}/v1/capacity"
    else:
        worker: str = args.worker
        if re.fullmatch(WORKER_ID_PATTERN, worker) is None:
            fail(f"not a valid worker id: {worker!r}", code=EXIT_USAGE)
        method, target = "POST", f"{base}/admin/{action}/{quote(worker, safe='')}"
    try:
        key = read_key_file(args.key_file)
    except KeyFileError as exc:
        fail(str(exc), code=EXIT_USAGE)
    try:
        with httpx.Client(
            trust_env=False, follow_redirects=False, timeout=_ADMIN_TIMEOUT_S
        ) as client:
            response = client.request(method, target, headers={b"Authorization": b"Bearer " + key})
    except httpx.HTTPError as exc:
        fail(
            f"cannot reach the router at {base}: {type(exc).__name__}: start it there "
            "('gateway-capacity router serve --workers FILE --key-file PATH'), or give the "
            "address it serves on with --url",
            code=EXIT_USAGE,
        )
    try:
        body: Any = msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        body = None
    if response.status_code != 200 or not isinstance(body, dict):
        reason = body.get("error") if isinstance(body, dict) else None
        reason = shown(reason or f"HTTP {response.status_code}")
        fail(f"router refused {action}: {reason}", EXIT_PROBLEM)
    if action == "show":
        try:  # show doubles as a contract check of what the router serves
            decode_snapshot(response.content)
        except ContractError as exc:
            fail(f"router answered an {shown(exc)}", EXIT_PROBLEM)
        if len(response.content) > MAX_SNAPSHOT_BYTES:  # every reader refuses it (R-P6)
            fail(
                f"router answered a snapshot of {len(response.content)} bytes, over the "
                f"contract's {MAX_SNAPSHOT_BYTES}: every gateway refuses it as too large",
                EXIT_PROBLEM,
            )
    snapshot = body if action == "show" else body.get("snapshot", {})
    workers, warnings = _workers(base, key) if action == "show" else (None, [])
    if args.json:
        doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        if action == "show":
            doc.update(snapshot=snapshot, workers=workers, warnings=warnings)
        else:
            doc.update(worker=args.worker, fenced=action == "fence", snapshot=snapshot)
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    if action != "show":
        state = "fenced" if action == "fence" else "restored"
        print(f"worker {args.worker} {state}")
    print(_describe_snapshot(snapshot))
    if workers is not None:
        print(_describe_workers(workers, warnings))
    return EXIT_OK


def _workers(base: str, key: bytes) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """The router's registered workers and their fences, and its warnings about them;
    None from a router without the endpoint (an older one): ``show`` then says nothing
    about fences."""
    import httpx

    try:
        with httpx.Client(
            trust_env=False, follow_redirects=False, timeout=_ADMIN_TIMEOUT_S
        ) as client:
            response = client.get(
                f"{base}/admin/workers", headers={b"Authorization": b"Bearer " + key}
            )
    except httpx.HTTPError:
        return None, []
    if response.status_code != 200:
        return None, []
    try:
        doc = response.json()
        listed = doc["workers"]
    except (ValueError, KeyError, TypeError):
        return None, []
    warnings = doc.get("warnings")
    warnings = [str(w) for w in warnings] if isinstance(warnings, list) else []
    return (listed, warnings) if isinstance(listed, list) else (None, [])


# What a worker that is not fenced but not counted either means for the snapshot
# (capacity_router.aggregate): an answering worker whose slots cannot be read makes it
# incomplete; one that is unhealthy or does not answer counts 0.
_NOT_COUNTED: Final = {
    "unreadable": "answers but its slots cannot be read, so the snapshot is incomplete",
    "unhealthy": "unhealthy, its slots count 0",
    "unreachable": "unreachable, its slots count 0",
}


def _describe_workers(workers: list[dict[str, Any]], warnings: list[str]) -> str:
    from capacity_contract import shown  # every field may carry a worker's own words

    fenced = [w for w in workers if w.get("fenced_by")]
    lines = [f"workers: {len(workers)} registered, {len(fenced)} fenced"]
    for w in workers:
        by = w.get("fenced_by")
        state = f"FENCED ({'admin: router unfence' if by == 'admin' else 'in the registry file'})"
        seen = w.get("state")
        name = shown(w.get("id"))
        if by:
            line = f"  {name}: {state}"
        elif seen is None or seen == "ok":
            line = f"  {name}: in service"
            if seen == "ok":
                line += f", {shown(w.get('slots'))} slots ({shown(w.get('reason'))})"
        else:
            not_counted = _NOT_COUNTED.get(str(seen), shown(seen))
            line = f"  {name}: not fenced, {not_counted} ({shown(w.get('reason'))})"
        unserved = w.get("unserved")
        if unserved:
            line += f"; does not serve {shown(', '.join(map(str, unserved)))} (counted 0)"
        unlisted = w.get("unlisted")
        if unlisted:
            line += (
                f"; lists none of {shown(', '.join(map(str, unlisted)))} but serves any model "
                "(counted; --alias names it)"
            )
        if w.get("activity"):
            line += f"; {shown(w.get('activity'))}"
        if seen == "ok" and not by:
            line += "; " + _describe_tokens(w)
        lines.append(line)
    lines.extend(f"warning: {shown(warning)}" for warning in warnings)
    return "\n".join(lines)


def _describe_tokens(w: dict[str, Any]) -> str:
    """A worker's token capacity as the router reports it (R-K7), or that it has none."""
    from capacity_contract import shown

    request, running = w.get("request_tokens"), w.get("running_tokens")
    if request is None and running is None:
        return "tokens: not stated (slots only)"
    text = f"tokens: {shown(request if request is not None else '?')} a request, "
    text += f"{shown(running if running is not None else '?')} running"
    if w.get("tokens_from"):
        text += f" ({shown(w.get('tokens_from'))})"
    return text


def _describe_snapshot(snapshot: dict[str, Any]) -> str:
    from capacity_contract import shown

    try:
        when = datetime.fromtimestamp(float(snapshot["observed_at"]), UTC).isoformat(
            timespec="milliseconds"
        )
    except (KeyError, TypeError, ValueError, OverflowError):
        when = "?"
    complete = "complete" if snapshot.get("complete") else "INCOMPLETE"
    lines = [f"snapshot observed {when} ({complete})"]
    for row in snapshot.get("models", []):
        line = f"  {shown(row.get('id'))}: {shown(row.get('max_concurrent_requests'))}"
        request, running = row.get("max_request_tokens"), row.get("max_running_tokens")
        if request is None and running is None:
            line += " (tokens: slots only)"
        else:
            line += f" (tokens: {shown(request if request is not None else '?')} a request, "
            line += f"{shown(running if running is not None else '?')} running)"
        lines.append(line)
    if len(lines) == 1:
        lines.append("  (no models)")
    return "\n".join(lines)
