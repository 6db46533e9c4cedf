"""A clone stands on its own: no pointer outside the repo, every cited R-id defined here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "docs" / "REQUIREMENTS.md"
OUTSIDE = re.compile(r"\.\./shared|SPEC\.md|seeds/")
R_ID = re.compile(r"\bR-[A-Z]\d+\b")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    files = []
    for name in out.stdout.splitlines():
        path = ROOT / name
        if (
            path.suffix in {".py", ".md", ".service", ".toml", ".json", ".txt", ""}
            and path.is_file()
        ):
            files.append(path)
    return files


def test_no_file_points_outside_the_repository() -> None:
    offenders = []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_cited_requirement_id_is_defined_in_requirements_md() -> None:
    defined = set(re.findall(r"\*\*(R-[A-Z]\d+)\*\*", REQUIREMENTS.read_text()))
    assert len(defined) >= 50  # C1-4, P1-9, K1-6, L1-9, A1-13, G1-6, W1-5
    cited: dict[str, str] = {}
    for path in _tracked_text_files():
        for rid in R_ID.findall(path.read_text(errors="replace")):
            cited.setdefault(rid, str(path.relative_to(ROOT)))
    undefined = {rid: where for rid, where in cited.items() if rid not in defined}
    assert not undefined, f"cited but not defined in docs/REQUIREMENTS.md: {undefined}"
