"""Shell completions (bash, zsh) and the man page, generated from the CLI's own parser.

``make completions`` runs ``python scripts/cli_files.py share``, which writes

- ``share/bash-completion/completions/gateway-capacity`` (shtab),
- ``share/zsh/site-functions/_gateway-capacity`` (shtab),
- ``share/man/man1/gateway-capacity.1`` (argparse-manpage),

under the layout ``make install`` copies into ``$(PREFIX)/share``. The files are
committed, so an operator's install needs neither generator; the test
``tests/repo/test_cli_files.py`` fails when they differ from what the parser gives
now. Options whose value is a path complete file names.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

PROG = "gateway-capacity"
PATH_METAVARS = {"PATH", "FILE", "PIDFILE", "PID|PIDFILE"}


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def build() -> argparse.ArgumentParser:
    import shtab

    # the man page's line breaks follow argparse's width, which follows the terminal's
    os.environ["COLUMNS"] = "70"
    from gateway_capacity.cli import build_parser

    parser = build_parser()
    for each in _parsers(parser):
        for action in each._actions:
            if action.option_strings and action.metavar in PATH_METAVARS:
                action.complete = shtab.FILE  # type: ignore[attr-defined]
    return parser


def texts() -> dict[str, str]:
    """Relative path under ``share/`` -> the text it should hold."""
    import shtab
    from argparse_manpage.manpage import Manpage

    from gateway_capacity.cli import package_version

    parser = build()
    page = Manpage(parser)
    page.date = ""  # reproducible: the version is in the footer
    page.source = f"{PROG} {package_version()}"
    page.manual = f"{PROG} manual"
    page.description = "capacity-following, generation-shared admission for an inference gateway"
    return {
        f"bash-completion/completions/{PROG}": shtab.complete(parser, shell="bash"),
        f"zsh/site-functions/_{PROG}": shtab.complete(parser, shell="zsh"),
        f"man/man1/{PROG}.1": str(page),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/cli_files.py SHARE_DIR", file=sys.stderr)
        return 2
    share = Path(argv[0])
    for relative, text in texts().items():
        path = share / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
