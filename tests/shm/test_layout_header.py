"""The core's layout header is generated from layout.py, and a core built for another
layout refuses to attach."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

import pytest

from shm_layout import _core, gen_header, layout

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_header_is_what_the_generator_writes_from_layout_py() -> None:
    committed = (ROOT / "shm_layout" / "_layout.h").read_text()
    assert committed == gen_header.render(), (
        "shm_layout/_layout.h differs from layout.py: run python -m shm_layout.gen_header"
    )


def test_the_generator_check_mode_fails_on_a_stale_header(tmp_path: Path) -> None:
    stale = tmp_path / "_layout.h"
    text = gen_header.render()
    stale.write_text(text.replace("#define HOLDER_STATE 0", "#define HOLDER_STATE 4"))
    code = (
        "import sys; from pathlib import Path; from shm_layout import gen_header; "
        f"gen_header.HEADER_PATH = Path({str(stale)!r}); sys.exit(gen_header.main(['--check']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 1, done
    assert "python -m shm_layout.gen_header" in done.stderr


def test_every_offset_the_core_is_handed_is_named_in_the_header() -> None:
    header = gen_header.render()
    for key in layout.core_offsets():
        assert f'X("{key}", ' in header, key
    assert tuple(_core.fields()) == tuple(layout.core_offsets())


def test_a_core_built_for_another_layout_refuses_to_attach_with_one_line() -> None:
    offsets = layout.core_offsets()
    offsets["k.state"] += 8
    buf = mmap.mmap(-1, layout.TOTAL_SIZE)
    try:
        with pytest.raises(_core.CoreError) as info:
            _core.Core(buf, offsets, layout.LOCK_FILE, "/nonexistent", False, "/gwcap-header-test")
    finally:
        buf.close()
    text = str(info.value)
    assert "\n" not in text
    assert "k.state" in text and "built for another layout" in text and "rebuild" in text
