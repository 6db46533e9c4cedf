"""Reference capacity router (REQUIREMENTS.md section 4, R-K5).

Answers ``GET /v1/capacity`` with the sum, per model id, of the slots of
distinct healthy, registered, unfenced workers. Shares only the contract
types (``sidecar.contract``) with the rest of the project. The HTTP server
(``RouterServer``) runs on asyncio (uvloop where installed) and
loads on first use; the rest, a router's client included, needs only the core.

Public API::

    from capacity_router import RouterServer, SimWorker
    with SimWorker(slots=10) as a, RouterServer("workers.json", "router.key") as router:
        router.snapshot(); router.fence("a"); router.unfence("a")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .aggregate import Observation, aggregate
from .keyfile import KeyFileError, read_key_file
from .poller import CapacityObserver, FencedInRegistry, UnknownWorker, WorkerStatus
from .registry import RegistryError, RegistryFile, RegistryWatcher, Worker, parse_registry
from .simworker import SimWorker

if TYPE_CHECKING:
    from .app import RouterServer

__all__ = [
    "CapacityObserver",
    "FencedInRegistry",
    "KeyFileError",
    "Observation",
    "RegistryError",
    "RegistryFile",
    "RegistryWatcher",
    "RouterServer",
    "SimWorker",
    "UnknownWorker",
    "Worker",
    "WorkerStatus",
    "aggregate",
    "parse_registry",
    "read_key_file",
]


def __getattr__(name: str) -> Any:
    if name == "RouterServer":
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module 'capacity_router' has no attribute {name!r}")
