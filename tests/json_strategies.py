"""Arbitrary JSON documents for the fuzz tests: one definition, sized per test file."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)


def json_values(width: int, leaves: int) -> st.SearchStrategy[Any]:
    """Nested lists and objects of at most ``width`` items and ``leaves`` scalars."""
    return st.recursive(
        json_scalars,
        lambda inner: (
            st.lists(inner, max_size=width)
            | st.dictionaries(st.text(max_size=10), inner, max_size=width)
        ),
        max_leaves=leaves,
    )
