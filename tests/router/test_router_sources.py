"""Each server kind read by the router, against simulated workers of that shape (R-K5).

The shapes answer as the real servers' source says (see capacity_router/simworker.py
and docs/router.md); tests/router/test_router_fixtures.py replays recorded answers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gwtest import stopped_at_exit
from router_support import rows, worker

from capacity_router import RouterServer, SimWorker

WORKER_KEY = "worker-key-8d1e4b"


@pytest.fixture
def shaped() -> Iterator[Callable[..., SimWorker]]:
    with stopped_at_exit(SimWorker.stop) as keep:

        def make(shape: Any, slots: int = 6, model: str = "wh", **kw: Any) -> SimWorker:
            w = SimWorker(slots=slots, model=model, shape=shape, **kw)
            w.start()
            return keep(w)

        yield make


def owner_only(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, text.encode() + b"\n")
    os.close(fd)
    return path


def status_of(r: RouterServer, worker_id: str) -> Any:
    return next(s for s in r.workers() if s.id == worker_id)


@pytest.mark.parametrize(
    ("shape", "slots", "expected"),
    [
        ("llama-server", {"source": "llama-server"}, 6),
        ("llama-server", {"source": "props"}, 6),
        ("llama-server-router", {"source": "llama-server-router"}, 6),
        ("sglang", {"source": "sglang"}, 6),
        ("tgi", {"source": "tgi"}, 6),
        ("lmstudio", {"source": "lmstudio"}, 6),
        ("vllm", {"source": "vllm", "fixed": 5}, 5),
        ("ollama", {"source": "ollama", "fixed": 3}, 3),
        ("llama-swap", {"source": "llama-swap"}, 6),
    ],
)
def test_r_k5_each_server_kind_gives_a_discovered_limit(
    shaped: Callable[..., SimWorker],
    router: Callable[..., RouterServer],
    shape: str,
    slots: dict[str, Any],
    expected: int,
) -> None:
    w = shaped(shape)
    r = router([worker("w", [w.url], ["wh"], slots)])
    snap = r.observe()
    assert snap.complete
    assert rows(snap) == {"wh": expected}


def test_r_k5_sglang_counts_per_dp_times_dp_ranks_and_reads_the_old_name(
    shaped: Callable[..., SimWorker], router: Callable[..., RouterServer]
) -> None:
    new = shaped("sglang", slots=8, dp_size=2)
    old = shaped("sglang", slots=3, old_names=True)
    r = router(
        [
            worker("new", [new.url], ["wh"], {"source": "sglang"}),
            worker("old", [old.url], ["wh"], {"source": "sglang"}),
        ]
    )
    assert rows(r.observe()) == {"wh": 8 + 3}
    new.set_healthy(False)  # 503 while starting: not counted, snapshot still complete
    snap = r.observe()
    assert (rows(snap), snap.complete) == ({"wh": 3}, True)


def test_r_k5_registry_id_a_worker_does_not_serve_counts_zero_and_is_warned_once(
    shaped: Callable[..., SimWorker],
    router: Callable[..., RouterServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = shaped("vllm")
    r = router([worker("w", [w.url], ["wh", "typo-model"], {"source": "vllm", "fixed": 4})])
    with caplog.at_level(logging.WARNING, logger="capacity_router"):
        r.observe()
        r.observe()
        snap = r.observe()
    assert rows(snap) == {"typo-model": 0, "wh": 4}
    assert status_of(r, "w").unserved == ("typo-model",)
    warned = [m for m in caplog.messages if "does not serve typo-model" in m]
    assert len(warned) == 1


def test_r_k5_llama_server_counts_an_id_it_does_not_list_and_warns(
    shaped: Callable[..., SimWorker],
    router: Callable[..., RouterServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # llama-server with one model (no --alias: it lists its file path) answers
    # whatever "model" a request names, so an id mismatch must not zero it.
    w = shaped("llama-server", model="/models/tiny.gguf")
    r = router([worker("w", [w.url], ["workhorse"], {"source": "props"})])
    with caplog.at_level(logging.WARNING, logger="capacity_router"):
        snap = r.observe()
    assert snap.complete and rows(snap) == {"workhorse": 6}
    assert status_of(r, "w").unlisted == ("workhorse",)
    assert status_of(r, "w").unserved == ()
    assert "does not list workhorse but serves any model" in caplog.text


def test_r_k5_a_server_that_routes_by_model_counts_an_unlisted_id_zero(
    shaped: Callable[..., SimWorker], router: Callable[..., RouterServer]
) -> None:
    w = shaped("vllm", model="served")
    r = router([worker("w", [w.url], ["served", "typo"], {"source": "vllm", "fixed": 4})])
    assert rows(r.observe()) == {"served": 4, "typo": 0}
    assert status_of(r, "w").unserved == ("typo",)


def test_r_k5_vllm_running_and_waiting_gauges_are_shown_as_activity(
    shaped: Callable[..., SimWorker], router: Callable[..., RouterServer]
) -> None:
    w = shaped("vllm")
    r = router([worker("w", [w.url], ["wh"], {"source": "vllm", "fixed": 4})])
    r.observe()
    assert status_of(r, "w").activity == "0 running, 0 waiting"
    w.set_healthy(False)  # /health 503: the engine is dead
    assert rows(r.observe()) == {"wh": 0}


def _router_mode(shaped: Callable[..., SimWorker], **states: str) -> SimWorker:
    """A llama-server in router mode with model "a" loaded (4 slots) and the others in
    ``states`` as named."""
    w = shaped("llama-server-router", slots=4, model="a")
    for model, state in states.items():
        w.set_model_state(model, state)
    return w


def test_r_k5_router_mode_reads_each_model_by_its_status_without_loading_any(
    shaped: Callable[..., SimWorker], router: Callable[..., RouterServer]
) -> None:
    w = _router_mode(shaped, b="sleeping", c="unloaded", d="loading")
    r = router([worker("w", [w.url], ["a", "b", "c", "d", "e"], {"source": "llama-server-router"})])
    snap = r.observe()
    # loaded and sleeping: their props; unloaded: 0 (no "fixed"); loading: unknown
    # (no row, incomplete); "e" is not offered at all: 0 and listed as unserved
    assert rows(snap) == {"a": 4, "b": 4, "c": 0, "e": 0}
    assert not snap.complete
    assert status_of(r, "w").unserved == ("e",)
    assert w.load_triggers == 0


def test_r_k5_router_mode_counts_no_failed_load_and_nothing_without_autoload(
    shaped: Callable[..., SimWorker], router: Callable[..., RouterServer]
) -> None:
    w = _router_mode(shaped, c="unloaded", f="failed")
    slots = {"source": "llama-server-router", "fixed": 2}
    r = router([worker("w", [w.url], ["a", "c", "f"], slots)])
    assert rows(r.observe()) == {"a": 4, "c": 2, "f": 0}  # a failed load is not retried
    w.models_autoload = False  # --no-models-autoload: a request for "c" gets 400
    assert rows(r.observe()) == {"a": 4, "c": 0, "f": 0}
    assert "no autoload" in status_of(r, "w").activity
    assert w.load_triggers == 0


def test_r_k5_router_mode_counts_fixed_for_a_model_it_loads_on_demand(
    shaped: Callable[..., SimWorker], router: Callable[..., RouterServer]
) -> None:
    w = _router_mode(shaped, c="unloaded")
    r = router([worker("w", [w.url], ["a", "c"], {"source": "llama-server-router", "fixed": 2})])
    assert rows(r.observe()) == {"a": 4, "c": 2}
    assert w.load_triggers == 0


def test_r_k5_llama_swap_is_read_from_running_without_touching_a_model(
    shaped: Callable[..., SimWorker], router: Callable[..., RouterServer]
) -> None:
    # /upstream/MODEL/... would pass llama-swap's admission and refresh the
    # model's ttl: the count comes from /running's cmd (--parallel 4) alone,
    # at most the concurrencyLimit (default 10, or "fixed").
    w = shaped("llama-swap", slots=4, model="a")
    w.set_model_state("b", "unloaded")
    r = router([worker("w", [w.url], ["a", "b"], {"source": "llama-swap"})])
    assert rows(r.observe()) == {"a": 4, "b": 0}
    limited = router([worker("w", [w.url], ["a", "b"], {"source": "llama-swap", "fixed": 2})])
    assert rows(limited.observe()) == {"a": 2, "b": 2}
    assert w.load_triggers == 0 and w.props_requests == 0
    assert status_of(r, "w").activity == "running: a"


def test_r_k5_llama_swap_parallel_is_read_from_the_command_line() -> None:
    from capacity_router.sources import parallel_of

    assert parallel_of("llama-server --port 5800 -m m.gguf --parallel 4") == 4
    assert parallel_of("llama-server -np 3 -c 8192") == 3
    assert parallel_of("llama-server --parallel=6") == 6
    assert parallel_of("llama-server -np 2 --parallel 5") == 5  # the last one wins
    assert parallel_of("llama-server --parallelism 4 -m x") is None
    assert parallel_of("llama-server -m /m/np 4") is None


def test_r_k5_lmstudio_model_without_loaded_instance_counts_zero(
    shaped: Callable[..., SimWorker], router: Callable[..., RouterServer]
) -> None:
    w = shaped("lmstudio", slots=4, model="a")
    w.set_model_state("b", "unloaded")
    r = router([worker("w", [w.url], ["a", "b", "zz"], {"source": "lmstudio"})])
    snap = r.observe()
    assert rows(snap) == {"a": 4, "b": 0, "zz": 0}
    assert status_of(r, "w").unserved == ("zz",)


@pytest.mark.parametrize("shape", ["llama-server", "sglang", "tgi", "vllm", "llama-swap"])
def test_r_k5_worker_with_api_key_is_read_with_its_key_file(
    shaped: Callable[..., SimWorker],
    router: Callable[..., RouterServer],
    tmp_path: Path,
    shape: str,
) -> None:
    w = shaped(shape, api_key=WORKER_KEY)
    slots: dict[str, Any] = {"source": "props" if shape == "llama-server" else shape}
    if shape == "vllm":
        slots["fixed"] = 6
    key = owner_only(tmp_path / "worker.key", WORKER_KEY)
    r = router([worker("w", [w.url], ["wh"], slots)])
    snap = r.observe()
    assert not snap.complete and rows(snap) == {}  # 401 without the key: unreadable
    assert "keyFile" in status_of(r, "w").reason
    r2 = router([worker("w", [w.url], ["wh"], slots, keyFile=str(key))])
    snap = r2.observe()
    assert snap.complete and rows(snap) == {"wh": 6}


def test_r_k5_worker_key_file_readable_by_others_is_refused_and_never_logged(
    shaped: Callable[..., SimWorker],
    router: Callable[..., RouterServer],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = shaped("llama-server", api_key=WORKER_KEY)
    key = owner_only(tmp_path / "worker.key", WORKER_KEY)
    key.chmod(0o644)
    with caplog.at_level(logging.DEBUG, logger="capacity_router"):
        r = router([worker("w", [w.url], ["wh"], {"source": "props"}, keyFile=str(key))])
        snap = r.observe()
    assert not snap.complete
    assert "chmod 600" in status_of(r, "w").reason
    assert WORKER_KEY not in caplog.text
    assert WORKER_KEY not in repr(r.workers())


def test_r_k5_worker_key_file_path_is_relative_to_the_registry(
    shaped: Callable[..., SimWorker],
    router: Callable[..., RouterServer],
    registry_path: Path,
) -> None:
    w = shaped("llama-server", api_key=WORKER_KEY)
    owner_only(registry_path.parent / "worker.key", WORKER_KEY)
    r = router([worker("w", [w.url], ["wh"], {"source": "props"}, keyFile="worker.key")])
    assert rows(r.observe()) == {"wh": 6}
