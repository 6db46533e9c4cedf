"""The shell completions and the man page `make install` installs.

They are generated from the CLI's parser by shtab and argparse-manpage
(``make completions``) and committed, so an install needs neither; these tests
fail when the committed files do not match the parser, and show that the
bash completion really completes.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARE = ROOT / "share"
BASH = SHARE / "bash-completion" / "completions" / "gateway-capacity"


def test_committed_completions_and_man_page_match_the_parser() -> None:
    # in a child process: the generator sets COLUMNS for argparse's line breaks
    code = (
        "import json, sys; sys.path.insert(0, 'scripts'); import cli_files; "
        "print(json.dumps(cli_files.texts()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    import json

    for relative, text in json.loads(out.stdout).items():
        committed = (SHARE / relative).read_text()
        assert committed == text, f"share/{relative} is stale: run `make completions`"


def _complete(*words: str) -> list[str]:
    """What bash offers after ``gateway-capacity WORDS...`` (the last word being typed)."""
    line = " ".join(("gateway-capacity", *words))
    script = (
        f"source {BASH}\n"
        f"COMP_WORDS=(gateway-capacity {' '.join(words)})\n"
        f"COMP_CWORD={len(words)}\n"
        f"COMP_LINE={line!r}\nCOMP_POINT=${{#COMP_LINE}}\n"
        "_shtab_gateway_capacity\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run([bash, "--norc", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_bash_completes_subcommands_nested_actions_and_their_options() -> None:
    assert set(_complete("wa")) == {"watch", "wait-for-slot"}
    assert _complete("router", "fe") == ["fence"]
    assert "--max-heartbeat-age" in _complete("availability", "--")
    assert "--key-file" in _complete("router", "show", "--")
    assert "--help" in _complete("router", "fence", "--")


def _roff(text: str) -> str:
    return text.replace("-", "\\-")


def test_the_man_page_has_a_section_for_every_subcommand_and_router_action() -> None:
    page = (SHARE / "man" / "man1" / "gateway-capacity.1").read_text()
    assert page.startswith(".TH GATEWAY\\-CAPACITY")
    from gateway_capacity.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    assert isinstance(commands, argparse._SubParsersAction)
    for name, sub in commands.choices.items():
        assert f".SH COMMAND \\fI\\,'{_roff('gateway-capacity ' + name)}'" in page, name
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for inner in action.choices:
                    assert f"'{_roff('gateway-capacity router ' + inner)}'" in page, inner


def test_each_command_parses_with_its_own_module_alone_as_with_every_module() -> None:
    """main() registers only the module of the command a line names: the table that says
    which module registers which command must be what the modules do register."""
    from gateway_capacity.cli import COMMANDS, build_parser

    def registered(parser: argparse.ArgumentParser) -> dict[str, str]:
        (commands,) = [a for a in parser._actions if a.dest == "command"]
        assert isinstance(commands, argparse._SubParsersAction)
        return {name: sub.format_help() for name, sub in commands.choices.items()}

    whole = registered(build_parser())
    assert list(whole) == [c for cs in COMMANDS.values() for c in cs]
    for name, text in whole.items():
        alone = registered(build_parser(name))
        assert alone[name] == text, name
        (module,) = [m for m, cs in COMMANDS.items() if name in cs]
        assert set(alone) == set(COMMANDS[module]), name
