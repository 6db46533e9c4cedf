"""Every process of a lock-file segment locks the same file, or refuses (R-A1, R-A5, R-A6).

The lock file is found by name (``$GATEWAY_CAPACITY_LOCK_DIR`` or ``/dev/shm``). A
process whose environment names another directory, or that comes after the file was
removed and made again, would lock a file nobody else locks: it would enter the section
beside the others, judge every other process's members dead through its own file and
reclaim their slots, and two would run on a limit of 1. So the creator stamps the file,
and an attacher whose file lacks the stamp refuses with one line saying what to fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from gwtest import LOCK_FILE_ENV, Agent

from handler_shim import Admission, SegmentError
from shm_layout import lock
from shm_layout.view import read_view


@pytest.mark.parametrize("how", ["another-lock-dir", "file-made-again"])
def test_r_a1_a_process_that_would_lock_another_file_refuses(
    how: str,
    segment_name: str,
    write_config: Callable[..., Path],
    agents: Callable[..., Agent],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv(LOCK_FILE_ENV, "1")
    monkeypatch.delenv(lock.LOCK_DIR_ENV, raising=False)
    cfg = write_config({"providers": [{"id": "p1", "maxConcurrent": 1}]})
    holder = agents("--segment", segment_name, "--config", str(cfg), "hold")
    holder.expect("admitted")
    path = lock.lock_file_path(segment_name)
    if how == "another-lock-dir":
        monkeypatch.setenv(lock.LOCK_DIR_ENV, str(tmp_path))
        path = lock.lock_file_path(segment_name)
    else:
        os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)  # a plausible file, not the one
    os.close(fd)
    with pytest.raises(SegmentError) as refused:
        late = Admission.attach(config=cfg, segment=segment_name, generation="late")
        late.close()
    message = str(refused.value)
    assert "lock file" in message and "\n" not in message, message
    p1 = read_view(segment_name).provider("p1")
    assert p1 is not None and p1.running == 1  # the holder's slot was never taken


def test_a_removed_lock_file_is_one_line_that_says_what_to_do(
    segment_name: str, write_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOCK_FILE_ENV, "1")
    cfg = write_config({"providers": [{"id": "p1"}]})
    Admission.attach(config=cfg, segment=segment_name, generation="first").close()
    os.unlink(lock.lock_file_path(segment_name))
    with pytest.raises(SegmentError, match=r"lock file .* is gone.*--unlink --force") as info:
        Admission.attach(config=cfg, segment=segment_name, generation="second")
    assert "\n" not in str(info.value)
