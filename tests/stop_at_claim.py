"""Run a process that stops itself (SIGSTOP) the moment it has claimed a provider row.

    python tests/stop_at_claim.py agent ARGS...    tests/agent.py ARGS...
    python tests/stop_at_claim.py cli ARGS...      gateway-capacity ARGS... (the sidecar)

A writer claims a provider row through ``shm_layout.writer.ensure_provider`` (a handler
that creates the segment, the sidecar's publication). Here that function is wrapped: when
it returns a row it has just claimed, the process stops itself, so a test holds it
frozen at the moment its row exists and looks at what another process can do there. It
is resumed (SIGCONT) or killed by the test. Only the first claim stops it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shm_layout import writer

_claim = writer.ensure_provider
_stopped = False


def _stop_once_claimed(*args: Any, **kwargs: Any) -> tuple[int, bool]:
    global _stopped
    p, created = _claim(*args, **kwargs)
    if created and not _stopped:
        _stopped = True
        os.kill(os.getpid(), signal.SIGSTOP)
    return p, created


writer.ensure_provider = _stop_once_claimed  # type: ignore[assignment]

if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "agent":
        sys.argv = [os.path.join(os.path.dirname(__file__), "agent.py"), *rest]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        from gateway_capacity.cli import main

        sys.exit(main(rest))
