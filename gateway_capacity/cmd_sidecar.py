"""``gateway-capacity sidecar``: run the capacity sidecar in the foreground."""

from __future__ import annotations

import argparse

from gateway_capacity.common import segment_arg
from gateway_capacity.exits import EXIT_USAGE
from gateway_capacity.logs import add_log_options

MAX_REFRESH_S = 25.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sidecar",
        help="probe opted-in providers and publish their limits into the segment",
        description="Polls GET {baseUrl}/capacity of every opted-in provider, publishes the "
        "effective limits with a heartbeat, reaps dead holders, follows config changes. "
        "Never writes the config file. SIGTERM/SIGINT stop it; the segment stays.",
    )
    p.add_argument("--config", metavar="PATH", required=True, help="the gateway's JSON config")
    p.add_argument(
        "--segment",
        metavar="NAME",
        type=segment_arg,
        help="segment name, with or without its leading / (default: from --config, "
        "or $GATEWAY_CAPACITY_SEGMENT)",
    )
    p.add_argument(
        "--refresh", type=float, default=15.0, metavar="S", help="probe period (default 15)"
    )
    p.add_argument(
        "--await-legacy",
        action="append",
        default=[],
        metavar="PID|PIDFILE",
        help="an older handler that cannot share counters: opted-in providers admit nothing "
        "new until it exits (repeatable)",
    )
    p.add_argument(
        "--await-legacy-grace",
        type=float,
        default=10.0,
        metavar="S",
        help="how long a --await-legacy pidfile may take to appear before start-up fails "
        "(default 10)",
    )
    p.add_argument(
        "--await-legacy-max",
        type=float,
        default=1800.0,
        metavar="S",
        help="a legacy drain longer than this is a WARNING and fails availability --check "
        "(default 1800: 30 minutes)",
    )
    p.add_argument(
        "--parent-pid", type=int, metavar="PID", help="exit when this process exits (macOS child)"
    )
    p.add_argument(
        "--group-shared",
        action="store_true",
        help="create the segment and semaphores 0660 (group) instead of 0600",
    )
    p.add_argument(
        "--owner",
        metavar="USER",
        help="another user the segment may belong to (the handlers' user, in group-shared "
        "mode); objects of anyone else are refused (default: $GATEWAY_CAPACITY_OWNER)",
    )
    p.add_argument(
        "--group",
        metavar="GROUP",
        help="group-shared mode: the group the segment must have (default: this process's "
        "group, or $GATEWAY_CAPACITY_GROUP)",
    )
    p.add_argument(
        "--metrics-listen", metavar="HOST:PORT", help="serve Prometheus metrics (off by default)"
    )
    add_log_options(p)
    p.add_argument(
        "--tailscale-socket", metavar="PATH", help="tailscaled LocalAPI socket (for whois)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gateway_capacity.logs import setup_logging
    from sidecar.daemon import Options, main

    setup_logging(args.log_format, args.log_level)
    if not 0 < args.refresh < MAX_REFRESH_S:  # also refuses nan and inf
        import logging

        logging.getLogger("gateway_capacity.sidecar").error(
            "--refresh must be a number of seconds above 0 and below %g: a discovered "
            "limit expires 30 s after its observation (R-L7), so a longer period would "
            "let it lapse between refreshes",
            MAX_REFRESH_S,
        )
        return EXIT_USAGE
    if not 0 <= args.await_legacy_grace <= 25:  # also refuses nan
        import logging

        logging.getLogger("gateway_capacity.sidecar").error(
            "--await-legacy-grace must be between 0 and 25 seconds: the sidecar is not ready "
            "while it waits, and the systemd unit allows 30 s to start (TimeoutStartSec=)"
        )
        return EXIT_USAGE
    if not 0 < args.await_legacy_max < float("inf"):  # also refuses nan
        import logging

        logging.getLogger("gateway_capacity.sidecar").error(
            "--await-legacy-max must be a number of seconds above 0"
        )
        return EXIT_USAGE
    return main(
        Options(
            config_path=args.config,
            refresh_s=args.refresh,
            segment=args.segment,
            await_legacy=args.await_legacy,
            await_legacy_grace_s=args.await_legacy_grace,
            await_legacy_max_s=args.await_legacy_max,
            parent_pid=args.parent_pid,
            group_shared=args.group_shared,
            owner=args.owner,
            group=args.group,
            tailscale_socket=args.tailscale_socket,
            metrics_listen=args.metrics_listen,
        )
    )
