"""The bad-input census in docs/RELIABILITY.md cannot drift from the suite.

Every test the census cites must exist, and every test whose name says it feeds
the product bad input (invalid, malformed, broken, refused, ...) must be cited
there, so a new one cannot be added without saying what the product does.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "RELIABILITY.md"

BAD_INPUT_WORDS = re.compile(
    r"invalid|_bad_|malformed|unusable|broken|garbage|corrupt|torn|refuse|usage_error"
    r"|not_ours|other_major|non_utf8|not_a_count|arbitrary|over_64|over_4_mib|oversize"
    r"|compressed|redirect|unrecognized|abbreviated|stale|never_escape|missing|wrong"
    r"|unreadable|scribbl"
)
# Names that match the words above but feed no bad input.
NOT_BAD_INPUT = {
    "test_help_lists_the_exit_codes",  # "usage" text, not a usage error
    "test_every_bad_input_test_is_in_the_census",  # this file
}


def section(title: str) -> str:
    """One ``## title`` section of docs/RELIABILITY.md (the censuses share this)."""
    text = DOC.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def census_text() -> str:
    return section("Bad-input census")


def suite_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        text = path.read_text()
        names.update(re.findall(r"^(?:async )?def (test_\w+)", text, re.M))
        names.update(re.findall(r"^(test_\w+) = ", text, re.M))  # a state machine's TestCase
    return names


def test_every_test_the_census_cites_exists() -> None:
    cited = set(re.findall(r"`(test_\w+)`", census_text()))
    assert cited, "the census cites no tests"
    missing = sorted(cited - suite_tests())
    assert missing == [], f"docs/RELIABILITY.md cites tests that do not exist: {missing}"


def attack_census_text() -> str:
    return section("Attack census")


def test_every_bad_input_test_is_in_the_census() -> None:
    """Cited in the bad-input census, or, for an attack, in the attack census beside it."""
    cited = set(re.findall(r"`(test_\w+)`", census_text() + attack_census_text()))
    bad_input = {n for n in suite_tests() if BAD_INPUT_WORDS.search(n)} - NOT_BAD_INPUT
    absent = sorted(bad_input - cited)
    assert absent == [], (
        "these tests feed bad input but the census in docs/RELIABILITY.md does not say "
        f"what the product does with it: {absent}"
    )
