"""The errors a handler can meet form one tree, exported by handler_shim (issue 13)."""

from __future__ import annotations

from pathlib import Path

import pytest

import handler_shim
from handler_shim import Admission

ERRORS = [
    name
    for name in handler_shim.__all__
    if isinstance(getattr(handler_shim, name), type)
    and issubclass(getattr(handler_shim, name), BaseException)
]


def test_every_exported_error_is_under_one_root_and_drawn_in_the_docstring() -> None:
    assert {"ConfigError", "BadSegmentName", "SegmentError", "AdmissionError"} <= set(ERRORS)
    doc = handler_shim.__doc__ or ""
    for name in ERRORS:
        assert issubclass(getattr(handler_shim, name), handler_shim.GatewayCapacityError), name
        assert f" {name}" in doc, f"{name} is not drawn in handler_shim's docstring"


def test_attach_with_an_unreadable_config_raises_the_exported_config_error(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "gateway.json"
    broken.write_text("{not json")
    with pytest.raises(handler_shim.ConfigError) as info:
        Admission.attach(config=broken, generation="tree-test")
    assert isinstance(info.value, handler_shim.GatewayCapacityError)
    assert str(broken) in str(info.value)


def test_attach_with_a_bad_segment_name_raises_bad_segment_name_still_a_value_error() -> None:
    with pytest.raises(handler_shim.BadSegmentName) as info:
        Admission.attach(segment="no slash and spaces", generation="tree-test")
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, handler_shim.GatewayCapacityError)
