"""One handler process of the benchmark, driven over stdin/stdout (one JSON object a line).

    python bench/gw_worker.py          # this checkout
    GWCAP_BENCH_SOURCE=DIR python bench/gw_worker.py   # another tree (bench_source.py)

Started with ``subprocess`` (not multiprocessing), so that a hundred of them start quickly
and import nothing of the benchmark's parent, and so that the same script runs another
revision's code for ``run.py --compare``. It uses only the API every layout has:
``Admission.attach(config=, generation=, segment=)``, ``slot_blocking()`` and ``slot()`` as
context managers. Each command gets one answer line; an exception is answered as
``{"error": ...}``. End of input (the parent gone) closes the admission and exits.

Commands (``op``): attach, hold, release, wait, waited, load, wakeups, refuse,
refuse_core, micro_setup,
calibrate, run, handoff, detach.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_source import use_source_from_env

use_source_from_env()

from handler_shim import Admission, QueueFull  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class Worker:
    def __init__(self) -> None:
        self.adm: Any = None
        self.held: list[Any] = []
        self.waited = 0
        self.wait_errors: list[str] = []
        self.lock = threading.Lock()
        self.cases: dict[str, Callable[[int], int]] = {}

    # --- admission --------------------------------------------------------------------
    def attach(self, segment: str, config: str | None = None) -> dict[str, Any]:
        self.adm = Admission.attach(config=config, generation="bench", segment=segment)
        return {"pid": os.getpid()}

    def hold(self, provider: str) -> dict[str, Any]:
        cm = self.adm.slot_blocking(provider, timeout=60)
        cm.__enter__()
        self.held.append(cm)
        return {}

    def release(self) -> dict[str, Any]:
        while self.held:
            self.held.pop().__exit__(None, None, None)
        return {}

    def wait(self, provider: str, count: int, mode: str = "blocking") -> dict[str, Any]:
        """``count`` requests that wait for ``provider`` (and leave at once when granted)."""

        def done(error: BaseException | None) -> None:
            with self.lock:
                self.waited += 1
                if error is not None:
                    self.wait_errors.append(f"{type(error).__name__}: {error}")

        if mode == "blocking":

            def one() -> None:
                try:
                    with self.adm.slot_blocking(provider, timeout=600):
                        pass
                except Exception as exc:
                    done(exc)
                else:
                    done(None)

            for _ in range(count):
                threading.Thread(target=one, daemon=True).start()
        else:
            import asyncio

            async def task() -> None:
                try:
                    async with self.adm.slot(provider, timeout=600):
                        pass
                except Exception as exc:
                    done(exc)
                else:
                    done(None)

            async def main() -> None:
                await asyncio.gather(*(task() for _ in range(count)))

            threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
        return {}

    def waited_count(self) -> dict[str, Any]:
        with self.lock:
            return {"waited": self.waited, "errors": list(self.wait_errors)}

    def load(self, segment: str, provider: str) -> dict[str, Any]:
        """(running, waiting) of ``provider`` as this tree's reader counts them."""
        from shm_layout import read_view

        view = read_view(segment).provider(provider)
        return {"load": [view.running, view.waiting] if view else None}

    def wakeups(self) -> dict[str, Any]:
        return {"wakeups": int(getattr(self.adm, "wakeups", 0))}

    def detach(self) -> dict[str, Any]:
        self.release()
        if self.adm is not None:
            self.adm.close()
            self.adm = None
        return {}

    # --- an arrival refused with QueueFull --------------------------------------------
    def refuse(self, provider: str, n: int) -> dict[str, Any]:
        slot = self.adm.slot_blocking
        refused = 0
        t0 = time.perf_counter_ns()
        for _ in range(n):
            try:
                with slot(provider):
                    pass
            except QueueFull:
                refused += 1
        elapsed = time.perf_counter_ns() - t0
        if refused != n:
            raise RuntimeError(f"only {refused} of {n} arrivals were refused")
        return {"ns": elapsed}

    def refuse_core(self, provider: str, n: int) -> dict[str, Any]:
        """The refusing core step alone (layout 3: ``Core.arrive``, nothing recorded)."""
        from shm_layout import _core

        ticket = self.adm.slot_blocking(provider)
        core, p, pid = ticket.core, ticket.provider, os.getpid()
        arrive = core.arrive
        if arrive(ticket, p, pid, 0.0, may_wait=True, blocking=False) != _core.FULL:
            raise RuntimeError("the arrival was not refused")
        t0 = time.perf_counter_ns()
        for _ in range(n):
            arrive(ticket, p, pid, 0.0, may_wait=True, blocking=False)
        return {"ns": time.perf_counter_ns() - t0}

    # --- uncontended acquire+release (run.py --compare) -------------------------------
    def micro_setup(self, provider: str, sem: str, shm: str) -> dict[str, Any]:
        import asyncio
        import mmap

        import posix_ipc
        from floor_loops import floor_runs

        adm = self.adm
        runner = asyncio.Runner()
        semaphore = posix_ipc.Semaphore(sem, posix_ipc.O_CREAT, 0o600, 1)
        memory = posix_ipc.SharedMemory(shm, posix_ipc.O_CREAT, 0o600, mmap.PAGESIZE)
        buf = mmap.mmap(memory.fd, mmap.PAGESIZE)
        memory.close_fd()

        def blocking(n: int) -> int:
            slot = adm.slot_blocking
            t0 = time.perf_counter_ns()
            for _ in range(n):
                with slot(provider):
                    pass
            return time.perf_counter_ns() - t0

        async def _async(n: int) -> int:
            slot = adm.slot
            t0 = time.perf_counter_ns()
            for _ in range(n):
                async with slot(provider):
                    pass
            return time.perf_counter_ns() - t0

        async def _sem(n: int) -> int:
            s = asyncio.Semaphore(4)
            t0 = time.perf_counter_ns()
            for _ in range(n):
                async with s:
                    pass
            return time.perf_counter_ns() - t0

        _one, floor2 = floor_runs(semaphore, buf)

        self.cases = {
            "shim_blocking": blocking,
            "shim_async": lambda n: runner.run(_async(n)),
            "asyncio": lambda n: runner.run(_sem(n)),
            "floor2": floor2,
        }
        return {}

    def calibrate(self, case: str, target_s: float) -> dict[str, Any]:
        run = self.cases[case]
        n = 200
        while True:
            elapsed = run(n)
            if elapsed >= 20_000_000 or n >= 2_000_000:
                break
            n *= 4
        return {"n": max(200, min(2_000_000, int(target_s * 1e9 * n / elapsed)))}

    def run(self, case: str, n: int) -> dict[str, Any]:
        return {"ns": self.cases[case](n)}

    # --- hand-off (limit 1, two workers ping-pong) ------------------------------------
    def handoff(
        self,
        provider: str,
        slots: int,
        hold_s: float,
        gap_s: float,
        start_ns: int,
        mode: str = "blocking",
    ) -> dict[str, Any]:
        now = time.monotonic_ns
        time.sleep(max(0.0, (start_ns - now()) / 1e9))
        records = []
        if mode == "blocking":
            slot = self.adm.slot_blocking
            for _ in range(slots):
                arrived = now()
                with slot(provider, timeout=30):
                    entered = now()
                    time.sleep(hold_s)
                    leaving = now()
                records.append((arrived, entered, leaving))
                time.sleep(gap_s)
        else:
            import asyncio

            async def run() -> None:
                for _ in range(slots):
                    arrived = now()
                    async with self.adm.slot(provider, timeout=30):
                        entered = now()
                        time.sleep(hold_s)  # the holder's body; nothing else runs here
                        leaving = now()
                    records.append((arrived, entered, leaving))
                    await asyncio.sleep(gap_s)

            asyncio.run(run())
        return {"pid": os.getpid(), "records": records}


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    worker = Worker()
    ops: dict[str, Callable[..., dict[str, Any]]] = {
        "attach": worker.attach,
        "hold": worker.hold,
        "release": worker.release,
        "wait": worker.wait,
        "waited": worker.waited_count,
        "wakeups": worker.wakeups,
        "load": worker.load,
        "refuse": worker.refuse,
        "refuse_core": worker.refuse_core,
        "micro_setup": worker.micro_setup,
        "calibrate": worker.calibrate,
        "run": worker.run,
        "handoff": worker.handoff,
        "detach": worker.detach,
    }
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            answer = ops[op](**command)
        except Exception as exc:
            answer = {"error": f"{op}: {type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    worker.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
