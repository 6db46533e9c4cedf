"""What an operator sees when the segment is another user's, damaged, or full: one line
that says what to do, never a traceback."""

from __future__ import annotations

import logging
import mmap
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from gwtest import as_nobody

from handler_shim import Admission, AdmissionError, SegmentError
from shm_layout import layout
from shm_layout.segment import Segment


def _cli(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("gateway-capacity")
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=30, user=user, cwd="/"
    )


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    text = (out.stderr + out.stdout).strip()
    assert "Traceback" not in text, text
    assert len(text.splitlines()) == 1, text
    return text


def _as_nobody(fn: Callable[[], int]) -> tuple[int, str]:
    """``fn`` as the user nobody (gwtest.as_nobody), with the CLI's parser built first:
    the child cannot import anything new from under /root."""
    import gateway_capacity.cli
    import gateway_capacity.cmd_views

    gateway_capacity.cli.build_parser()
    return as_nobody(fn)


def _one_line_text(text: str) -> str:
    text = text.strip()
    assert "Traceback" not in text, text
    assert len(text.splitlines()) == 1, text
    return text


def test_another_users_segment_is_one_line_for_every_command(segment_name: str) -> None:
    from gateway_capacity.cli import main

    Segment.open(segment_name).close()  # root's, owner-only
    for args in (
        ["availability", "--segment", segment_name],
        ["inspect", "--segment", segment_name],
        ["inspect", "--segment", segment_name, "--unlink", "--force"],
    ):
        code, output = _as_nobody(lambda args=args: main(args))
        assert code != 0, output
        line = _one_line_text(output)
        assert "another user" in line or "may not open" in line, line

    def attach() -> int:
        try:
            Admission.attach(segment=segment_name, generation="x")
        except SegmentError as exc:
            print(exc)
            return 2
        return 0

    code, output = _as_nobody(attach)
    assert code == 2, output
    assert "may not open" in _one_line_text(output)


def test_a_damaged_segment_is_named_as_damaged(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    """A valid header followed by random bytes: inspect and availability say "damaged"
    in one line (no traceback), and attach refuses it as damaged with the command that
    removes it, not as a full table."""
    cfg = write_config({"providers": [{"id": "p1"}]})
    Admission.attach(config=cfg, segment=segment_name, generation="g").close()
    import posix_ipc

    shm = posix_ipc.SharedMemory(segment_name)
    buf = mmap.mmap(shm.fd, layout.TOTAL_SIZE)
    shm.close_fd()
    rng = random.Random(1)
    buf[layout.HEADER_SIZE :] = rng.randbytes(layout.TOTAL_SIZE - layout.HEADER_SIZE)
    buf.close()
    for args in (("availability",), ("inspect",), ("availability", "--json")):
        out = _cli(*args, "--segment", segment_name)
        assert out.returncode != 0
        assert "damaged" in _one_line(out)
    with pytest.raises(SegmentError, match=r"damaged.*--unlink --force"):
        Admission.attach(config=cfg, segment=segment_name, generation="g")


def test_the_129th_attach_says_the_table_is_full_and_nothing_else(
    segment_name: str, write_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    cfg = write_config({"providers": [{"id": "p1"}]})
    caplog.set_level(logging.WARNING)
    attached = []
    try:
        for i in range(layout.MEMBER_COUNT):
            attached.append(Admission.attach(config=cfg, segment=segment_name, generation=f"g{i}"))
        with pytest.raises(AdmissionError, match=f"already has {layout.MEMBER_COUNT} attached"):
            Admission.attach(config=cfg, segment=segment_name, generation="one-too-many")
        assert "repair" not in caplog.text and "died" not in caplog.text, caplog.text
        with attached[0].slot_blocking("p1", timeout=1):  # the others are unharmed
            pass
    finally:
        for adm in attached:
            adm.close()
