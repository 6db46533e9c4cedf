"""How the demo and the upgrade drill (``drill/``) run: real processes that must all be
gone at the end, whatever ends the run.

Inside :func:`always_cleaned_up`, SIGTERM stops the run as Ctrl-C does (the process
a supervisor or a test terminates cleans up the same way), an interrupt is recorded
as a problem, and the clean-up runs in every case; whatever it could not remove is a
problem too. A run's own failures are the caller's to catch, inside the block.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Ending:
    left: list[str] = field(default_factory=list)  # what the clean-up could not remove


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextmanager
def always_cleaned_up(cleanup: Callable[[], list[str]], problems: list[str]) -> Iterator[Ending]:
    """Run the block, then ``cleanup()`` (which returns what it left); ``problems`` gets
    "interrupted" for Ctrl-C or SIGTERM and "not cleaned up: ..." for what was left."""
    ending = Ending()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield ending
    except KeyboardInterrupt:
        problems.append("interrupted")
    finally:
        ending.left = cleanup()
        signal.signal(signal.SIGTERM, previous)
    if ending.left:
        problems.append(f"not cleaned up: {', '.join(ending.left)}")
