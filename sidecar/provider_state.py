"""What the sidecar knows of one provider between two decisions: its rules and entry,
the last probe, the decision in force and what it was built into. The daemon owns it;
share mode's loop (``sidecar.share_loop``) reads its rules and decision."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from shm_layout import writer
from sidecar.config import ProviderConfig
from sidecar.limits import LimitDecision, ProviderRules
from sidecar.replica import ProviderProbe


@dataclass
class ProviderState:
    rules: ProviderRules
    config: ProviderConfig
    probe: ProviderProbe | None = None
    decision: LimitDecision | None = None
    last_discovered: LimitDecision | None = None  # R-L6's base, kept across a failed refresh
    logged: tuple[int, str, str] | tuple[()] = ()  # what the daemon last logged of it
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # the Publication last built for this provider and what it was built from
    publication: writer.Publication | None = None
    built_from: tuple[object, ...] = ()
