"""Reference capacity router (REQUIREMENTS.md section 4, R-K5).

Answers ``GET /v1/capacity`` with the sum, per model id, of the slots of
distinct healthy, registered, unfenced workers. Shares only the contract
types (``capacity_contract``) with the rest of the project. The HTTP server
(``RouterServer``) runs on asyncio (uvloop where installed) and
loads on first use; the rest, a router's client included, needs only the core.

Public API::

    from capacity_router import RouterServer, SimWorker
    with SimWorker(slots=10) as a, RouterServer("workers.json", "router.key") as router:
        router.snapshot(); router.fence("a"); router.unfence("a")
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Imported now: the function ``aggregate`` shares its name with its module,
# which a lazy import would leave on the package instead.
from .aggregate import Observation, aggregate

if TYPE_CHECKING:
    from .app import RouterServer
    from .keyfile import KeyFileError, read_key_file
    from .poller import CapacityObserver, FencedInRegistry, UnknownWorker, WorkerStatus
    from .registry import RegistryError, RegistryFile, RegistryWatcher, Worker, parse_registry
    from .simworker import SimWorker

# Loaded on first use, so that ``capacity_router.kinds`` (the CLI's list of
# server kinds) costs no HTTP client, and the server no starlette until served.
_HOME = {
    "RouterServer": "app",
    "KeyFileError": "keyfile",
    "read_key_file": "keyfile",
    "CapacityObserver": "poller",
    "FencedInRegistry": "poller",
    "UnknownWorker": "poller",
    "WorkerStatus": "poller",
    "RegistryError": "registry",
    "RegistryFile": "registry",
    "RegistryWatcher": "registry",
    "Worker": "registry",
    "parse_registry": "registry",
    "SimWorker": "simworker",
}

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
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'capacity_router' has no attribute {name!r}")
    return getattr(import_module(f".{home}", __name__), name)
