"""The attack census in docs/RELIABILITY.md cannot drift from the suite.

Every test the census cites must exist, and every test whose name says it attacks the
product (another user, a storm, a kill, a stop, damage, a removed segment, a closed
event loop, a stepped clock, ...) must be cited there, so a new attack cannot be added
without saying what the product does about it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "RELIABILITY.md"

ATTACK_WORDS = re.compile(
    r"another_user|nobody|squat|decoy|storm|sigkill|stopped|paused|gil_hog|pid_namespace"
    r"|bad_write|damaged|removed_by_hand|closed_event_loop|stepped|umask|doorbell_names"
    r"|close_runs|close_waits|close_begins"
)


# Names that match the words above but attack nothing.
NOT_ATTACKS = {
    "test_notify_socket_with_nobody_listening_returns_false_without_raising",
    "test_r_k5_unhealthy_and_stopped_workers_are_not_counted_and_return_when_back",
    "test_handler_as_another_user_attaches_and_takes_a_slot",  # the set-up working as meant
}


def census_text() -> str:
    text = DOC.read_text()
    start = text.index("## Attack census")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def suite_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.update(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
    return names


def test_every_test_the_attack_census_cites_exists() -> None:
    cited = set(re.findall(r"`(test_\w+)`", census_text()))
    assert cited, "the attack census cites no tests"
    missing = sorted(cited - suite_tests())
    assert missing == [], (
        f"docs/RELIABILITY.md's attack census cites tests that do not exist: {missing}"
    )


def test_every_attack_test_is_in_the_attack_census() -> None:
    cited = set(re.findall(r"`(test_\w+)`", census_text()))
    attacks = {n for n in suite_tests() if ATTACK_WORDS.search(n)} - NOT_ATTACKS
    absent = sorted(attacks - cited)
    assert absent == [], (
        "these tests attack the product but the attack census in docs/RELIABILITY.md does "
        f"not say what it does about them: {absent}"
    )
