"""The docs and the CLI name the same options.

Every option of every subcommand appears in the document that describes that
subcommand, and every option a documented command line gives a subcommand
exists. Options are read from the real parser; command lines are the lines of
README.md, docs/*.md and examples/README.md that run ``gateway-capacity SUB``
(with their ``\\`` continuations).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from gateway_capacity.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# where each subcommand's options are described
HOME = {
    "sidecar": ["README.md", "docs/systemd.md", "docs/metrics.md"],
    "availability": ["README.md"],
    "inspect": ["README.md"],
    "watch": ["README.md"],
    "segments": ["README.md"],
    "check-config": ["docs/probe.md"],
    "verify": ["README.md"],
    "wait-for-slot": ["docs/wait-for-slot.md"],
    "router serve": ["docs/router.md"],
    "router fence": ["docs/router.md"],
    "router unfence": ["docs/router.md"],
    "router show": ["docs/router.md"],
    "router check": ["docs/router.md"],
    "router simworker": ["docs/router.md"],
    "demo": ["README.md"],
}
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def subcommand_options() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if path and not subs:
            found[path] = {
                option
                for action in parser._actions
                if action.help != argparse.SUPPRESS
                for option in action.option_strings
                if option.startswith("--") and option != "--help"
            }
        for action in subs:
            for name, child in action.choices.items():
                walk(child, f"{path} {name}".strip())

    walk(build_parser(), "")
    return found


def documented_command_lines() -> list[tuple[str, str, str]]:
    """(file, subcommand, the command line) for every documented run of the CLI."""
    commands = sorted(subcommand_options(), key=len, reverse=True)
    lines: list[tuple[str, str, str]] = []
    for path in DOCS:
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            for match in re.finditer(r"gateway-capacity ((?:router )?[a-z-]+)", line):
                sub = match.group(1)
                if sub in commands:
                    rest = line[match.end() :]
                    cut = re.search(r"\s(?:&&|\||;|#)\s|`", rest)
                    lines.append((path.name, sub, rest[: cut.start()] if cut else rest))
    return lines


def test_every_option_of_every_subcommand_is_documented() -> None:
    options = subcommand_options()
    assert set(options) == set(HOME)
    missing = []
    for sub, names in options.items():
        text = "\n".join((ROOT / home).read_text() for home in HOME[sub])
        missing += [f"{sub} {name} (in {', '.join(HOME[sub])})" for name in sorted(names)
                    if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)]  # fmt: skip
    assert not missing, "undocumented:\n" + "\n".join(missing)


def test_every_documented_option_exists() -> None:
    options = subcommand_options()
    unknown = []
    for where, sub, line in documented_command_lines():
        for name in OPTION.findall(line):
            if name not in options[sub] and name not in ("--help", "--version"):
                unknown.append(f"{where}: gateway-capacity {sub} ... {name}")
    assert not unknown, "documented but not an option:\n" + "\n".join(unknown)
    assert len(documented_command_lines()) > 40  # the scan found the docs' command lines
