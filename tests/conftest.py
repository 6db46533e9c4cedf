"""Fixtures shared by the cross-process tests: unique segments, configs, agent processes."""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gwtest, under importlib mode

from gwtest import LOCK_FILE_ENV, NO_TIMEOUT_ENV, Agent, P1Segment, stopped_at_exit


@pytest.fixture
def segment_name() -> Iterator[str]:
    """A fresh segment name (removed afterwards, with its semaphores)."""
    from shm_layout.segment import unlink_segment

    name = "/gwt-" + secrets.token_hex(6)
    yield name
    unlink_segment(name)


@pytest.fixture
def key() -> str:
    """A unique, recognisable key, so a leak check can search every output for it (R-P7)."""
    return "sk-test-" + secrets.token_hex(16)


@pytest.fixture
def key_file(tmp_path: Path, key: str) -> Path:
    """``key`` in a 0600 file, newline-terminated as an editor leaves it."""
    path = tmp_path / "provider.key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    def write(doc: dict[str, Any], name: str = "gateway.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        return path

    return write


@pytest.fixture
def p1_segment(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> Callable[..., P1Segment]:
    """``p1_segment(limit)``: ``segment_name`` and a config of one provider, p1, with that
    static limit (none: the default's); keyword arguments are the config's top-level
    fields (``maxConcurrent=99``)."""

    def make(limit: int | None = None, **gateway: Any) -> P1Segment:
        p1: dict[str, Any] = {"id": "p1"}
        if limit is not None:
            p1["maxConcurrent"] = limit
        return P1Segment(segment_name, write_config({**gateway, "providers": [p1]}), agents)

    return make


# --- macOS, and the darwin test mode (R-A10, docs/macos.md) ---------------------------------
# ``GATEWAY_CAPACITY_PLATFORM=darwin`` makes shm_layout.platform answer as macOS does, and
# raise where macOS has no such call; the processes a test starts inherit it. It stands
# in for a macOS kernel, which no machine of this project has: the calls both systems
# have run Linux's implementation. A test that needs a Linux feature itself (reading
# /dev/shm or /proc, unshare, systemd, the robust mutex, faketime...) says so with
# ``@pytest.mark.linux("what")``, and is skipped, with that reason, on macOS and in the
# darwin test mode. `make test` runs the admission, sidecar, CLI and ASGI suites a second
# time in the darwin test mode (Makefile: DARWIN_TESTS).
def _darwin_where() -> str | None:
    from shm_layout import platform

    if not platform.is_darwin():
        return None
    if sys.platform == "darwin":
        return "on macOS"
    return f"in the darwin test mode (${platform.PLATFORM_ENV}=darwin)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "linux(reason): needs a Linux feature; skipped with the reason on macOS and in the "
        "darwin test mode",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    where = _darwin_where()
    if where is None:
        return
    for item in items:
        mark = item.get_closest_marker("linux")
        if mark is not None:
            reason = mark.args[0] if mark.args else "a Linux feature"
            item.add_marker(pytest.mark.skip(reason=f"needs Linux: {reason} (skipped {where})"))


@pytest.fixture(params=["linux", "macos-path"])
def sem_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on Linux's own path (robust mutex in the segment, semaphore timeouts
    available) and on the path macOS takes, forced here (a lock file beside the segment,
    no semaphore timeouts: R-A10). Segments created under the test use that lock; every
    process attaching follows what the segment's header says. On macOS and in the darwin
    test mode there is only the macOS path: the "linux" run is skipped."""
    where = _darwin_where()
    if request.param == "linux" and where is not None:
        pytest.skip(f"the Linux path (robust mutex, timed semaphore waits) does not exist {where}")
    if request.param == "macos-path":
        monkeypatch.setenv(NO_TIMEOUT_ENV, "1")
        monkeypatch.setenv(LOCK_FILE_ENV, "1")
    else:
        monkeypatch.delenv(NO_TIMEOUT_ENV, raising=False)
        monkeypatch.delenv(LOCK_FILE_ENV, raising=False)
    return str(request.param)


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    """Start tests/agent.py processes; every one is killed afterwards."""
    with stopped_at_exit(Agent.kill) as keep:
        yield lambda *args, env=None: keep(Agent(list(args), env=env))


# Modules whose tests share one expensive module-scoped fixture (a booted
# container, a built wheel: two builds at once in one checkout race on its
# egg-info): all their tests go to one xdist worker, in order. xdist's own
# --dist loadgroup does not group under pytest 9 (it renames node ids, which
# pytest 9 no longer reads back), so the scheduler is chosen here.
ONE_WORKER_MODULES = ("tests/systemd/test_nspawn.py::", "tests/repo/test_wheel.py::")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class _Scheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            for prefix in ONE_WORKER_MODULES:
                if nodeid.startswith(prefix):
                    return prefix
            return nodeid  # every other test is its own unit, as with --dist load

    return _Scheduling(config, log)
