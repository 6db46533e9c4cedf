"""The errors a handler can meet form one tree, defined in shm_layout.errors and
exported by handler_shim."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from gwtest import P1Segment

import handler_shim
import shm_layout.errors
from handler_shim import Admission

ERRORS = [
    name
    for name in handler_shim.__all__
    if isinstance(getattr(handler_shim, name), type)
    and issubclass(getattr(handler_shim, name), BaseException)
]


def _drawn_tree() -> dict[str, str | None]:
    """Each class drawn in shm_layout.errors' docstring, with the class drawn above it."""
    doc = shm_layout.errors.__doc__ or ""
    parents: dict[str, str | None] = {}
    stack: list[str] = []
    for line in doc.splitlines():
        match = re.match(r"^    ([│ ]*(?:[├└]── )?)([A-Z]\w+)", line)
        if match is None:
            continue
        depth = len(match.group(1)) // 4
        del stack[depth:]
        parents[match.group(2)] = stack[-1] if stack else None
        stack.append(match.group(2))
    return parents


def test_every_exported_error_is_under_one_root_and_drawn_in_the_errors_module() -> None:
    assert {"ConfigError", "BadSegmentName", "SegmentError", "AdmissionError"} <= set(ERRORS)
    drawn = _drawn_tree()
    for name in ERRORS:
        cls = getattr(handler_shim, name)
        assert issubclass(cls, handler_shim.GatewayCapacityError), name
        assert cls.__module__ == "shm_layout.errors", f"{name} is defined in {cls.__module__}"
        assert name in drawn, f"{name} is not drawn in shm_layout.errors' docstring"


def test_the_drawn_tree_is_the_class_tree_and_names_every_class_of_the_module() -> None:
    drawn = _drawn_tree()
    defined = {
        name
        for name, value in vars(shm_layout.errors).items()
        if isinstance(value, type) and issubclass(value, Exception)
    }
    assert set(drawn) == defined
    for name, parent in drawn.items():
        cls = getattr(shm_layout.errors, name)
        ours = [base.__name__ for base in cls.__bases__ if base.__module__ == "shm_layout.errors"]
        assert ours == ([parent] if parent else []), (name, ours, parent)
    assert set(ERRORS) == defined, "handler_shim exports every error of shm_layout.errors"


def test_the_core_raises_the_classes_of_the_errors_module() -> None:
    from shm_layout import _core

    assert _core.CoreError is shm_layout.errors.CoreError
    assert _core.DamagedLock is shm_layout.errors.DamagedLock


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
    from gwtest import segment_made_by_nobody

    from shm_layout.segment import SegmentError, unlink_segment

    segment_made_by_nobody(segment_name)
    try:
        with pytest.raises(handler_shim.ForeignSegment) as info:
            Admission.attach(segment=segment_name, generation="tree-test")
        text = str(info.value)
        assert "--group-shared" in text and "owner=" in text, text
        assert isinstance(info.value, SegmentError)
    finally:
        unlink_segment(segment_name)


def test_r_a13_an_unknown_provider_lists_the_providers_the_segment_has(
    adm: Admission,
) -> None:
    with pytest.raises(handler_shim.UnknownProvider) as info:
        adm.slot_blocking("p2", timeout=1)
    assert "'p2'" in str(info.value) and "(its providers: p1)" in str(info.value)
    # a near miss of an id the segment has is named, as the CLI and the example do
    with pytest.raises(handler_shim.UnknownProvider) as info:
        adm.slot_blocking("p10", timeout=1)
    assert "'p10'" in str(info.value) and "did you mean 'p1'?" in str(info.value), info.value


def _waiting(adm: Admission) -> int:
    from shm_layout.view import read_view

    view = read_view(adm.segment_name).provider("p1")
    assert view is not None
    return view.waiting


def test_r_a4_a_timeout_names_the_provider_the_timeout_and_the_queue_ahead(
    p1_segment: Callable[..., P1Segment],
) -> None:
    """One running on a limit of 1 and one waiter queued first: a later request that
    times out says so, in the blocking and the async form."""
    adm = p1_segment(1).attach("tree-test")
    try:
        with adm.slot_blocking("p1", timeout=1):
            first = threading.Thread(target=_wait_then_leave, args=(adm,))
            first.start()
            deadline = time.monotonic() + 10
            while _waiting(adm) < 1:
                assert time.monotonic() < deadline, "the first waiter never queued"
                time.sleep(0.01)
            with (
                pytest.raises(handler_shim.AdmissionTimeout) as info,
                adm.slot_blocking("p1", timeout=0.2),
            ):
                pass
            assert str(info.value) == (
                "provider p1: no slot was granted within the timeout of 0.2 s: 1 running on "
                "a limit of 1 (provider), 1 waiting ahead of it in the queue"
            )

            async def late() -> None:
                async with adm.slot("p1", timeout=0.25):
                    pass

            with pytest.raises(handler_shim.AdmissionTimeout) as later:
                asyncio.run(late())
            assert "provider p1: no slot was granted within the timeout of 0.25 s" in str(
                later.value
            )
            assert "1 waiting ahead of it in the queue" in str(later.value)
        first.join(timeout=10)
    finally:
        adm.close()


def _wait_then_leave(adm: Admission) -> None:
    with adm.slot_blocking("p1", timeout=30):
        pass
