"""README's count of the tests `make check` runs and of the whole suite stays true: the
counts come from what pytest collects, as the README says to count them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_readme_counts_the_fast_tier_and_the_suite_as_pytest_collects_them() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"about ([\d,]+) of the ([\d,]+) tests", readme)
    assert said is not None, "README: 'about N of the M tests'"
    fast, total = _number(said[1]), _number(said[2])
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
         "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    found = re.search(r"(\d+)/(\d+) tests collected", out.stdout)
    assert found is not None, out.stdout[-2000:] + out.stderr[-2000:]
    real_fast, real_total = int(found[1]), int(found[2])
    # "about": within 10 %, so that a round of new tests does not make it false at once
    assert abs(fast - real_fast) <= real_fast // 10, (fast, real_fast)
    assert abs(total - real_total) <= real_total // 10, (total, real_total)
