"""Provider ids are matched in full; a full table never stops the providers that fit (R-A13)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from handler_shim import Admission, AdmissionTimeout, UnknownProvider
from shm_layout import layout


def test_r_a13_sixty_five_providers_leave_the_first_64_working(
    segment_name: str, write_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """65 providers configured: attach still works, the first 64 get their budgets and the
    65th is refused by name with the table's size, never a TableFull for every handler."""
    count = layout.PROVIDER_COUNT + 1
    cfg = write_config({"providers": [{"id": f"p{i}", "maxConcurrent": 1} for i in range(count)]})
    caplog.set_level(logging.WARNING)
    adm = Admission.attach(config=cfg, segment=segment_name, generation="many")
    try:
        assert "p64" in caplog.text and "at most 64 providers" in caplog.text
        for i in (0, 31, 63):
            with adm.slot_blocking(f"p{i}", timeout=1):
                pass
        with pytest.raises(UnknownProvider, match=r"p64.*no budget.*at most 64 providers"):
            adm.slot_blocking("p64")
    finally:
        adm.close()


@pytest.mark.parametrize(
    ("configured", "asked"),
    [
        ("a" * 64, "a" * 65),
        ("a" * 64, "a" * 64 + "SUFFIX"),
        ("é" * 32, "é" * 33),
    ],
    ids=["65-bytes", "suffix", "utf-8"],
)
def test_r_a13_ids_are_matched_in_full_never_by_prefix(
    configured: str,
    asked: str,
    segment_name: str,
    write_config: Callable[..., Path],
) -> None:
    """With 'a'*64 configured (limit 1) and held, slot('a'*65) and slot('a'*64 + 'SUFFIX')
    are refused as unknown, never admitted against that provider's budget."""
    cfg = write_config({"providers": [{"id": configured, "maxConcurrent": 1}]})
    adm = Admission.attach(config=cfg, segment=segment_name, generation="ids")
    try:
        with adm.slot_blocking(configured, timeout=1):
            with pytest.raises(UnknownProvider, match="bytes"):
                adm.slot_blocking(asked)
            with (  # the real one is full, as it should be
                pytest.raises(AdmissionTimeout),
                adm.slot_blocking(configured, timeout=0.2),
            ):
                pass
    finally:
        adm.close()


def test_r_a13_an_id_too_long_for_the_segment_is_refused_when_the_config_is_loaded(
    write_config: Callable[..., Path],
) -> None:
    from sidecar.config import load_config

    cfg = write_config({"providers": [{"id": "a" * 65}, {"id": "ok"}]})
    loaded = load_config(cfg)
    assert [p.id for p in loaded.providers] == ["ok"]
    assert any("65" in why and "bytes" in why for why in loaded.skipped), loaded.skipped
