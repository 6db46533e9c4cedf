"""Fixtures of the admission tests run in this process."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from gwtest import P1Segment

from handler_shim import Admission


@pytest.fixture
def adm(p1_segment: Callable[..., P1Segment]) -> Iterator[Admission]:
    """This process attached (generation "test") to a fresh segment where p1's limit is 2."""
    a = p1_segment(2).attach("test")
    yield a
    a.close()
