"""``gateway-capacity`` entry point.

Each subcommand lives in its own module with ``register(subparsers)``, which
adds its parser and sets ``func`` to a ``run(args) -> int``. Heavy imports
(httpx, the daemon) happen inside ``run`` so that ``--help`` and the handler
side stay light. A command line that names its command imports that command's
module alone (``availability`` in a health check every few seconds pays for
the views, not for the router, the config checker and the demo); ``--help``,
a mistyped command and the generated completions see them all.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import signal
import sys

from gateway_capacity import common
from gateway_capacity.exits import EXIT_USAGE

# subcommand module and the commands it registers, in the order --help lists them
# (tests/repo/test_cli_files.py holds this table to what the modules register)
COMMANDS: dict[str, tuple[str, ...]] = {
    "gateway_capacity.cmd_sidecar": ("sidecar",),
    "gateway_capacity.cmd_views": ("availability", "inspect", "watch"),
    "gateway_capacity.cmd_segments": ("segments",),
    "gateway_capacity.cmd_check_config": ("check-config",),
    "gateway_capacity.cmd_verify": ("verify",),
    "gateway_capacity.wait_for_slot": ("wait-for-slot",),
    "gateway_capacity.cmd_router": ("router",),
    "gateway_capacity.demo": ("demo",),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with ``command`` (a command's name) only that command's
    module registered: what parsing a command line that names it needs."""
    parser = argparse.ArgumentParser(
        prog="gateway-capacity",
        allow_abbrev=False,
        description="Capacity-following, generation-shared admission for an inference gateway.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, commands in COMMANDS.items():
        if command is None or command in commands:
            # a module that fails to import is a broken install: say so
            importlib.import_module(name).register(sub)
    _no_abbreviations(parser)
    return parser


def _named_command(argv: list[str]) -> str | None:
    """The command a command line names, when it is one of ours and nothing before it
    asks for the top level (``--help``, ``--version``: they need every command)."""
    for word in argv:
        if word.startswith("-"):
            return None
        return word if any(word in commands for commands in COMMANDS.values()) else None
    return None


class _Version(argparse._VersionAction):
    """argparse's ``version`` action, with the version read only when asked for: reading
    it imports importlib.metadata, which every command would otherwise pay for."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"{parser.prog} {package_version()}")
        parser.exit()


def package_version() -> str:
    """The installed distribution's version (pyproject.toml), never a second copy of it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gateway-capacity")
    except PackageNotFoundError:
        return "unknown (not installed: pip install .)"


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """``--key`` must never be taken for ``--key-file`` (and its value then echoed as a
    path): no prefix matching in any parser or subparser."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _no_abbreviations(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(_named_command(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse would echo them, and a stray word may be a pasted key (R-P7, R-W3).
        # The usage shown is the subcommand's, where the mistyped option belongs.
        chosen = _chosen(parser, args)
        chosen.print_usage(sys.stderr)
        print(f"gateway-capacity: error: {unknown_arguments(chosen, extra)}", file=sys.stderr)
        return EXIT_USAGE
    common.json_errors = bool(getattr(args, "json", False))
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_went_away()
    return code


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subparser ``args`` came through (``router fence``, ``watch``, ...)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            child = action.choices.get(getattr(args, action.dest, None) or "")
            if child is not None:
                return _chosen(child, args)
    return parser


def _reader_went_away() -> int:
    """``gateway-capacity inspect --json | head``: the reader closed the pipe. End quietly
    as coreutils do (status 128 + SIGPIPE), and keep the interpreter's final flush of
    stdout from printing a traceback of its own."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def unknown_arguments(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """The error line for the words ``parser`` did not take: a mistyped option is named
    with the option it most resembles (``unknown option --confg; did you mean
    --config?``) and its value is shown when it names an existing file or is a number.
    Any other word is not shown: it may be a pasted key (R-P7, R-W3)."""
    takes_value = {
        o: action.nargs != 0
        for action in parser._actions
        for o in action.option_strings
        if o.startswith("--")
    }
    parts: list[str] = []
    stray: list[str] = []
    words = iter(enumerate(extra))
    for i, word in words:
        if not (word.startswith("--") and len(word) > 2):
            stray.append(_safe_word(word))
            continue
        name, eq, value = word.partition("=")
        near = difflib.get_close_matches(name, list(takes_value), n=1, cutoff=0.75)
        if (
            not eq
            and near
            and takes_value[near[0]]
            and i + 1 < len(extra)
            and not extra[i + 1].startswith("-")
        ):
            value = extra[i + 1]  # the value meant for the option it resembles
            eq = " "
            next(words)
        given = name + (eq + (value if _harmless(value) else "(not shown)") if eq else "")
        hint = f"; did you mean {near[0]}?" if near else ""
        parts.append(f"unknown option {name}{hint}" + (f" (given: {given})" if eq else ""))
    if stray:
        parts.append(f"unrecognized arguments: {' '.join(stray)}")
    return "; ".join(parts)


def _harmless(value: str) -> bool:
    """A value safe to echo: the name of an existing file or a number, never a key."""
    try:
        float(value)
    except ValueError:
        return os.path.exists(value)
    return True


def _safe_word(word: str) -> str:
    """An option name is shown (a typo is worth seeing); values and bare words are not."""
    if word.startswith("--") and len(word) > 2:
        name, eq, _ = word.partition("=")
        return name + ("=(not shown)" if eq else "")
    return "(a word, not shown)"


if __name__ == "__main__":
    sys.exit(main())
