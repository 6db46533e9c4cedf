"""Admission charged in tokens, measured beside admission in slots alone.

Uncontended ``slot_blocking`` acquire+release from one thread, four providers of one
segment, the rounds interleaved (every case once a round) so that the shared machine's
noise falls on all alike: slots alone (``fifo``), slots with two classes (``classes``),
and the same two with a token budget published (``tokens``, ``tokens-classes``: the
budget as a sidecar writes it, far above what the charges reach, so nothing waits)
and every request charged ``CHARGE`` tokens. The target: a charged admission within
1.5x of the same admission uncharged.
"""

from __future__ import annotations

import inspect
import json
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from bench_common import Cleanup

LIMIT = 4
CHARGE = 512
TOKEN_BUDGET = 1 << 20
CLASSES = [{"name": "interactive", "reserve": 1}, {"name": "batch"}]
# case: (provider, class, tokens)
CASES: dict[str, tuple[str, str | None, int]] = {
    "slots": ("fifo", None, 0),
    "tokens": ("tokens", None, CHARGE),
    "classes": ("classes", "interactive", 0),
    "tokens_classes": ("tokens-classes", "interactive", CHARGE),
}
LABELS = {
    "slots": "slot_blocking, slots alone",
    "tokens": f"slot_blocking(tokens={CHARGE}), token budget",
    "classes": "slot_blocking, two classes",
    "tokens_classes": f"slot_blocking(tokens={CHARGE}), two classes, token budget",
}
BASE = {"slots": "slots", "tokens": "slots", "classes": "classes", "tokens_classes": "classes"}


def unsupported() -> str | None:
    """Why this checkout cannot be measured, or None."""
    from handler_shim import Admission
    from shm_layout import writer

    if "tokens" not in inspect.signature(Admission.slot_blocking).parameters:
        return "this checkout's admission takes no tokens"
    if "token_limit" not in inspect.signature(writer.Publication).parameters:
        return "this checkout's publication carries no token budget"
    return None


def _config(cleanup: Cleanup) -> str:
    path = os.path.join(cleanup.tempdir(), "gateway.json")
    doc = {
        "providers": [
            {"id": "fifo", "maxConcurrent": LIMIT},
            {"id": "classes", "maxConcurrent": LIMIT, "classes": CLASSES},
            {"id": "tokens", "maxConcurrent": LIMIT},
            {"id": "tokens-classes", "maxConcurrent": LIMIT, "classes": CLASSES},
        ]
    }
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def _publish_budgets(adm: Any, config: str) -> None:
    """Publish every provider as a sidecar would: ``tokens`` and ``tokens-classes`` with a
    discovered limit of LIMIT and a token budget, the other two static."""
    from gateway_config import read_config_file
    from shm_layout import writer
    from shm_layout.layout import Source

    seg = adm._seg
    now = time.time()
    epoch = writer.take_epoch(seg, os.getpid(), 0.0, now, 1.0, "bench")
    pubs = []
    for provider in read_config_file(config).providers:
        budget = provider.id.startswith("tokens")
        extra: dict[str, Any] = {}
        if budget:
            extra = dict(
                limit=LIMIT,
                reason="published by the benchmark",
                observed_at=now,
                expires_at=now + 3600,
                token_limit=TOKEN_BUDGET,
            )
        pubs.append(
            writer.Publication(
                provider.id,
                budget,
                LIMIT,
                Source.PROVIDER,
                classes=provider.class_specs,
                default_class=provider.default_class_index,
                **extra,
            )
        )
    writer.publish(seg, epoch, 1, "ok", pubs, now)


def _cost(adm: Any, provider: str, cls: str | None, tokens: int, ops: int) -> float:
    slot = adm.slot_blocking
    kwargs: dict[str, Any] = {"cls": cls} if cls else {}
    if tokens:
        kwargs["tokens"] = tokens
    start = time.perf_counter_ns()
    for _ in range(ops):
        with slot(provider, **kwargs):
            pass
    return (time.perf_counter_ns() - start) / ops


def run_tokens(
    cleanup: Cleanup, rounds: int, ops: int, log: Callable[[str], None]
) -> dict[str, list[float]]:
    """Nanoseconds per acquire+release, per case, one value a round."""
    from handler_shim import Admission

    config = _config(cleanup)
    segment = cleanup.segment("/gwb-t" + secrets.token_hex(5))
    adm = Admission.attach(config=config, segment=segment, generation="bench")
    cleanup.push("admission", adm.close)
    _publish_budgets(adm, config)
    for provider, cls, tokens in CASES.values():  # warm: rows looked up, code paths hot
        _cost(adm, provider, cls, tokens, 1000)
    cost: dict[str, list[float]] = {key: [] for key in CASES}
    for r in range(rounds):
        log(f"tokens: cost round {r + 1}/{rounds}")
        for key, (provider, cls, tokens) in CASES.items():
            cost[key].append(_cost(adm, provider, cls, tokens, ops))
    return cost


# -- instruction counts (valgrind --tool=callgrind): what the shared machine cannot blur --

CALLGRIND_OPS = (100, 600)
# os.getppid's C function: the child calls it between two loops, and callgrind dumps its
# counts there (--dump-before), so that one run under valgrind measures every case
MARKER = "os_getppid"


def run_callgrind(cleanup: Cleanup, log: Callable[[str], None]) -> dict[str, float] | str:
    """Instructions per acquire+release, per case, from one process under ``valgrind
    --tool=callgrind``: each case's loop run ``CALLGRIND_OPS[0]`` then
    ``CALLGRIND_OPS[1]`` times, callgrind dumping its counts before each loop and after
    the last; the difference of a case's two loops over the difference of their counts
    (what the loop costs once, its set-up, cancels). Instruction counts do not depend on
    the machine's load, as the wall-clock figures do. Returns why not instead when
    valgrind is not installed."""
    import shutil
    import subprocess
    import sys

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return "valgrind is not installed"
    data = os.path.join(cleanup.tempdir(), "callgrind.out")
    log("tokens: callgrind, one run of every case (minutes: valgrind runs python ~50x slower)")
    subprocess.run(
        [
            valgrind,
            "--tool=callgrind",
            f"--callgrind-out-file={data}",
            f"--dump-before={MARKER}",
            sys.executable,
            os.path.abspath(__file__),
            *map(str, CALLGRIND_OPS),
        ],
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # dump k (k >= 1) holds what ran between marker k-1 and marker k; marker 0 ends the
    # set-up, then each case's two loops end with a marker each
    parts = [_callgrind_total(f"{data}.{k}") for k in range(2, 2 + 2 * len(CASES))]
    spread = CALLGRIND_OPS[1] - CALLGRIND_OPS[0]
    return {case: (parts[2 * i + 1] - parts[2 * i]) / spread for i, case in enumerate(CASES)}


def _callgrind_total(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{path}: no summary line")


def _marked_loops(small: int, large: int) -> None:
    """What callgrind counts: set up as run_tokens does, warm every case, then each case
    ``small`` and ``large`` times, a marker (os.getppid) after the set-up and each loop."""
    from handler_shim import Admission

    cleanup = Cleanup()
    try:
        config = _config(cleanup)
        segment = cleanup.segment("/gwb-c" + secrets.token_hex(5))
        adm = Admission.attach(config=config, segment=segment, generation="bench")
        cleanup.push("admission", adm.close)
        _publish_budgets(adm, config)
        for provider, cls, tokens in CASES.values():
            _cost(adm, provider, cls, tokens, 200)
        os.getppid()
        for provider, cls, tokens in CASES.values():
            for ops in (small, large):
                _cost(adm, provider, cls, tokens, ops)
                os.getppid()
    finally:
        cleanup.run()


if __name__ == "__main__":
    import sys

    _marked_loops(int(sys.argv[1]), int(sys.argv[2]))
