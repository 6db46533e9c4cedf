"""availability --json carries every key of section 8, with a publishing writer."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from gwtest import P1Segment, run_cli

from shm_layout import layout, rows, writer
from shm_layout.liveness import my_identity
from shm_layout.view import ReplicaView

PROVIDER_KEYS = {
    "id",
    "capacity_discovery",
    "effective_limit",
    "source",
    "reason",
    "running",
    "waiting",
    "queue_bound",
    "fallback_limit",
    "discovered",
    "observed_at",
    "expires_at",
    "replicas",
}
REPLICA_KEYS = {"address", "ok", "complete", "value", "reason", "observed_at"}
SIDECAR_KEYS = {"pid", "alive", "heartbeat_age_s", "writer_epoch"}


def test_availability_json_has_the_spec_keys(p1_segment: Callable[..., P1Segment]) -> None:
    seg = p1_segment(12)
    segment_name, cfg = seg.name, seg.config
    adm = seg.attach("handler-2.0")
    try:
        pid, start = my_identity()
        epoch = writer.take_epoch(adm._seg, pid, start, time.time(), 15.0, str(cfg))
        now = time.time()
        writer.publish(
            adm._seg,
            epoch,
            1,
            "ok",
            [
                writer.Publication(
                    "p1",
                    True,
                    12,
                    "provider",
                    limit=10,
                    reason="discovered 20, capped",
                    discovered=10,
                    observed_at=now - 1,
                    expires_at=now + 29,
                    replicas=[ReplicaView("127.0.0.1", True, True, 20, "ok", now - 1)],
                )
            ],
            now,
        )
        out = run_cli("availability", "--segment", segment_name, "--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert {"segment", "layout", "sidecar", "generations", "providers"} <= set(doc)
        assert doc["segment"] == segment_name
        assert doc["layout"] == {"major": layout.MAJOR, "minor": layout.MINOR}
        assert set(doc["sidecar"]) >= SIDECAR_KEYS
        assert doc["sidecar"]["pid"] == os.getpid() and doc["sidecar"]["writer_epoch"] == epoch
        assert doc["generations"][0]["generation"] == "handler-2.0"
        p1 = doc["providers"][0]
        assert set(p1) >= PROVIDER_KEYS
        assert (p1["effective_limit"], p1["source"], p1["discovered"]) == (10, "discovered", 10)
        assert set(p1["replicas"][0]) >= REPLICA_KEYS
        assert p1["replicas"][0]["value"] == 20
    finally:
        adm.close()


def test_r_a16_a_scribbled_fallback_source_reads_as_the_default_in_both_documents(
    p1_segment: Callable[..., P1Segment],
) -> None:
    """Every code a damaged byte can hold in a provider's fallback source: availability
    and inspect still print their documents, and the fallback source is one of the three
    their schema allows ("default" for a code that names no fallback)."""
    seg = p1_segment(12)
    adm = seg.attach("handler-2.0")
    try:
        buf = adm._seg.buf
        fallback_source = layout.PROVIDER["fallback_source"]
        for code in (0, 1, 2, 5, 6, 7, 255):
            fallback_source.put(buf, code, rows.provider_base(0))
            for command in ("availability", "inspect"):
                out = run_cli(command, "--segment", seg.name, "--json")
                assert out.returncode == 0, (code, command, out.stderr)
                got = json.loads(out.stdout)["providers"][0]["fallback_source"]
                named = layout.SOURCES.get(code)
                want = named if named in layout.FALLBACK_SOURCES else "default"
                assert got == want, (code, command, got)
    finally:
        adm.close()


def test_r_a16_a_scribbled_fallback_limit_reads_as_the_core_applies_it(
    p1_segment: Callable[..., P1Segment],
) -> None:
    """A fallback limit written over with a value no writer writes (negative, or beyond
    the running room): both documents still print, with the limit the core would apply
    (clamped to 0..RUNNING_ROOM), which their schema allows."""
    seg = p1_segment(12)
    adm = seg.attach("handler-2.0")
    try:
        fallback_limit = layout.PROVIDER["fallback_limit"]
        for stored, shown in ((-1, 0), (-(2**31), 0), (2**31 - 1, layout.RUNNING_ROOM)):
            fallback_limit.put(adm._seg.buf, stored, rows.provider_base(0))
            for command in ("availability", "inspect"):
                out = run_cli(command, "--segment", seg.name, "--json")
                assert out.returncode == 0, (stored, command, out.stderr[-300:])
                got = json.loads(out.stdout)["providers"][0]["fallback_limit"]
                assert got == shown, (stored, command, got)
    finally:
        adm.close()
