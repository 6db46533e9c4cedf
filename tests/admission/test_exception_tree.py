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


def _subclasses(root: type[BaseException]) -> set[type[BaseException]]:
    found: set[type[BaseException]] = set()
    for child in root.__subclasses__():
        found |= {child} | _subclasses(child)
    return found


def test_every_error_of_the_tree_a_handler_can_meet_is_exported() -> None:
    """What ``handler_shim`` stands on (the segment, its owners, the core, the config
    types) raises only errors a handler can catch by their exported name."""
    import handler_shim.asgi  # every module a handler loads
    import shm_layout.writer  # noqa: F401
    import sidecar.config  # noqa: F401

    ours = ("shm_layout.", "handler_shim.", "sidecar.config")
    tree = {
        cls.__name__
        for cls in _subclasses(handler_shim.GatewayCapacityError)
        if cls.__module__.startswith(ours) and not cls.__name__.startswith("_")
    }
    assert {"ForeignSegment", "OwnerError", "TableFull", "CoreError"} <= tree
    assert tree <= set(ERRORS), f"not exported: {sorted(tree - set(ERRORS))}"


def test_a_segment_this_user_may_not_open_names_the_options_that_share_it(
    segment_name: str,
) -> None:
    """The refusal names what to set on each side: ``--group-shared`` and ``owner=``."""
    from gwtest import as_nobody

    from shm_layout.segment import Segment, SegmentError, unlink_segment

    def make() -> int:
        Segment.open(segment_name).close()
        return 0

    assert as_nobody(make)[0] == 0
    try:
        with pytest.raises(handler_shim.ForeignSegment) as info:
            Admission.attach(segment=segment_name, generation="tree-test")
        text = str(info.value)
        assert "--group-shared" in text and "owner=" in text, text
        assert isinstance(info.value, SegmentError)
    finally:
        unlink_segment(segment_name)
