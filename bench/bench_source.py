"""Import the product from another source tree (``$GWCAP_BENCH_SOURCE``) for a before/after.

The venv's editable install puts a finder on ``sys.meta_path`` that wins over
``PYTHONPATH``; this takes it out and puts the other tree first. Bench-only.
"""

from __future__ import annotations

import os
import sys

ENV = "GWCAP_BENCH_SOURCE"


def use_source_from_env() -> str | None:
    source = os.environ.get(ENV)
    if not source:
        return None
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, source)
    return source


if __name__ == "__main__":  # python bench_source.py ARGS...: the CLI, from that tree
    import runpy

    use_source_from_env()
    sys.argv = ["gateway-capacity", *sys.argv[1:]]
    runpy.run_module("gateway_capacity", run_name="__main__", alter_sys=True)
