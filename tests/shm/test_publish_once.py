"""A refresh publishes in one transaction that writes only what changed.

Counted by the segment's own ``lock_seq`` (+1 per lock acquisition), not by time.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from shm_layout import writer
from shm_layout.layout import HEADER
from shm_layout.segment import Segment
from shm_layout.view import ReplicaView, read_view

PROVIDERS = 64


def _publications(observed: float, limit: int = 20) -> list[writer.Publication]:
    return [
        writer.Publication(
            provider_id=f"p{i}",
            discovery=True,
            fallback=4,
            fallback_source="gateway",
            limit=limit,
            reason=f"discovered {limit}",
            discovered=limit,
            observed_at=observed,
            expires_at=observed + 30,
            replicas=[
                ReplicaView(f"127.0.0.{r + 1}", True, True, limit, "ok: loopback", observed)
                for r in range(4)
            ],
        )
        for i in range(PROVIDERS)
    ]


def test_a_refresh_of_64_providers_is_one_lock_acquisition_and_nothing_new_is_none(
    segment_name: str,
) -> None:
    seg = Segment.open(segment_name, create=True)
    try:
        now = time.time()
        epoch = writer.take_epoch(seg, 1, 1.0, now, 1.0, "/c.json")
        cache = writer.PublishCache()
        writer.publish(seg, epoch, 1, "ok", _publications(now - 1), now, cache)  # rows claimed

        def locks_taken(pubs: list[writer.Publication]) -> int:
            before = HEADER["lock_seq"].get(seg.buf)
            writer.publish(seg, epoch, 1, "ok", pubs, time.time(), cache)
            return int(HEADER["lock_seq"].get(seg.buf) - before)

        assert locks_taken(_publications(now)) == 1  # every row changed: one transaction
        assert locks_taken(_publications(now)) == 0  # nothing changed: no transaction
        assert locks_taken(_publications(now, limit=7)) == 1
        view = read_view(segment_name)
        assert [p.effective_limit for p in view.providers] == [7] * PROVIDERS
        assert {p.observed_at for p in view.providers} == {now}
        assert all(r.value == 7 for p in view.providers for r in p.replicas)
    finally:
        seg.close()


def test_a_cached_publish_leaves_the_segment_as_an_uncached_one_would(segment_name: str) -> None:
    """The diff is an optimisation only: the same rows as writing everything afresh."""
    seg = Segment.open(segment_name, create=True)
    try:
        now = time.time()
        epoch = writer.take_epoch(seg, 1, 1.0, now, 1.0, "/c.json")
        cache = writer.PublishCache()
        first = _publications(now - 2)
        writer.publish(seg, epoch, 1, "ok", first, now, cache)
        second = _publications(now - 1, limit=9)[:40]  # 24 providers left the config
        second[3] = writer.Publication("p3", False, 5, "provider")  # turned static
        writer.publish(seg, epoch, 2, "ok", second, now, cache)
        cached = [
            (p.id, p.effective_limit, p.source, p.reason, p.fallback_limit, len(p.replicas))
            for p in read_view(segment_name).providers
        ]
        writer.publish(seg, epoch, 2, "ok", second, now)  # no cache: everything written
        fresh = [
            (p.id, p.effective_limit, p.source, p.reason, p.fallback_limit, len(p.replicas))
            for p in read_view(segment_name).providers
        ]
        assert cached == fresh
        assert cached[3][1:3] == (5, "provider")
        assert cached[50][3] == "not in the config any more"
    finally:
        seg.close()


def test_r_l9_a_publication_of_an_unknown_limit_source_is_refused_not_published(
    segment_name: str,
) -> None:
    """A source that is none of layout.Source's (a misspelling) raises, naming the known
    ones; the row keeps what it had instead of a limit labelled "discovered"."""
    seg = Segment.open(segment_name, create=True)
    try:
        now = time.time()
        epoch = writer.take_epoch(seg, 1, 1.0, now, 1.0, "/c.json")
        good = _publications(now - 1)[:1]
        writer.publish(seg, epoch, 1, "ok", good, now, writer.PublishCache())
        bad = dataclasses.replace(good[0], limit=3, source="discoverd")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown limit source 'discoverd': one of discov"):
            writer.publish(seg, epoch, 1, "ok", [bad], now, writer.PublishCache())
        (row,) = read_view(segment_name).providers
        assert (row.effective_limit, row.source) == (20, "discovered")
    finally:
        seg.close()
