"""Hypothesis settings for the fuzz tests: brief in ``make test``, no deadlines.

The machine is shared and noisy, so no example has a deadline; the example
counts keep the whole directory to a few seconds. ``HYPOTHESIS_PROFILE=fuzz-long``
runs many more examples when hunting.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "fuzz-brief", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "fuzz-long", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fuzz-brief"))
