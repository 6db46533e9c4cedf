"""Options and helpers every subcommand shares."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import NoReturn

from gateway_capacity.exits import EXIT_USAGE
from shm_layout.errors import BadSegmentName
from shm_layout.names import resolve_segment_name


def add_target_options(
    parser: argparse.ArgumentParser,
    *,
    segment_help: str = "shared-memory segment name, with or without its leading / "
    "(default: derived from --config, or $GATEWAY_CAPACITY_SEGMENT)",
) -> None:
    """Every command takes ``--config PATH`` or ``--segment NAME`` (REQUIREMENTS.md section 8)."""
    parser.add_argument("--config", metavar="PATH", help="the gateway's JSON config file")
    parser.add_argument("--segment", metavar="NAME", type=segment_arg, help=segment_help)


def segment_arg(text: str) -> str:
    """``--segment gwcap1-...`` as ``ls /dev/shm`` shows it means ``/gwcap1-...``: POSIX
    names start with the ``/`` that the listing leaves out. Checked when it is used."""
    return text if text.startswith("/") or not text else "/" + text


def segment_from_args(args: argparse.Namespace) -> str:
    """The segment name the arguments select, or exit 2 with a one-line reason."""
    try:
        return resolve_segment_name(getattr(args, "segment", None), getattr(args, "config", None))
    except BadSegmentName as exc:
        fail(str(exc), code=EXIT_USAGE)


# Set by the entry point when the command runs with --json: errors are JSON then too.
json_errors = False


def fail(message: str, code: int) -> NoReturn:
    """One line that says what to fix, then exit ``code``. In ``--json`` mode the line
    is ``{"error": "..."}`` on stdout, so a caller parsing stdout gets JSON either way."""
    if json_errors:
        from gateway_capacity.schemas import SCHEMA_VERSION

        print(json.dumps({"schema_version": SCHEMA_VERSION, "error": message}))
    else:
        print(f"gateway-capacity: {message}", file=sys.stderr)
    raise SystemExit(code)


ROUTER_EXTRA = ("uvloop", "httptools")


def require_router_extra(what: str) -> None:
    """Exit 2 with the install command when ``what`` needs the reference router's HTTP
    stack (the ``router`` extra) and it is not installed: a handler host has no need of it.
    """
    missing = [name for name in ROUTER_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        fail(
            f"{what} needs {' and '.join(missing)}: install the router extra "
            "(pip install 'gateway-capacity[router]')",
            code=EXIT_USAGE,
        )
