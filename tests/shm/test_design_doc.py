"""docs/DESIGN.md's byte tables must say what shm_layout/layout.py does."""

from __future__ import annotations

import re

from gwtest import ROOT

from shm_layout import layout

_TYPES = {"I": "u32", "i": "i32", "Q": "u64", "d": "f64", "H": "u16", "B": "u8"}
_TABLES = {
    "Header": layout.HEADER,
    "Provider row": layout.PROVIDER,
    "Replica row": layout.REPLICA,
    "Class row": layout.CLASS,
    "Holder record": layout.HOLDER,
    "Member row (a registered handler process)": layout.MEMBER,
}


def _documented() -> dict[str, list[tuple[int, int, str, str]]]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    out: dict[str, list[tuple[int, int, str, str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("### "):
            current = line[4:].strip()
            out[current] = []
            continue
        m = re.match(r"\| (\d+) \| (\d+) \| (\S+) \| `(\w+)` \|", line)
        if m and current is not None:
            out[current].append((int(m[1]), int(m[2]), m[3], m[4]))
    return out


def test_design_doc_byte_tables_match_the_layout() -> None:
    documented = _documented()
    for title, fields in _TABLES.items():
        expected = []
        for name, f in fields.items():
            fmt = f.codec.format.lstrip("<")
            expected.append(
                (f.offset, f.codec.size, _TYPES.get(fmt, f"bytes[{f.codec.size}]"), name)
            )
        assert documented.get(title) == expected, title


def test_design_doc_states_the_segment_size() -> None:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    assert f"{layout.TOTAL_SIZE:,} bytes" in text
