"""Share mode beside a per-request Redis semaphore in LiteLLM's style, in one run.

Three share-mode sidecars (three segments) in front of ``capacity_farm.py`` (6 slots)
and one private redis-server. Measured:

* the per-request cost in share mode (``slot_blocking`` enter+exit on a gateway whose
  limit is its share) and, on the same Redis, a LiteLLM-style semaphore: one sorted
  set of slot ids per key, each with a TTL (ZREMRANGEBYSCORE + ZCARD + ZADD in one
  script to acquire, ZREM to release);
* how long a crashed gateway's capacity stays lost: ours, from a SIGKILL of the
  sidecar holding a share to the moment another gateway is granted it; theirs, from
  a worker that never releases to the moment its slot can be taken again (its TTL);
* the time for a demand shift to move capacity from one gateway to another;
* Redis operations per second per gateway, idle and under a moving demand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

from bench_common import Cleanup, median, new_segment_name, stop_popen
from bench_redis import start_redis

HERE = os.path.dirname(os.path.abspath(__file__))
EXE = os.path.join(os.path.dirname(sys.executable), "gateway-capacity")
LEASE_S = 2.0
SLOTS = 6  # capacity_farm.py's
THEIR_TTL_S = 3.0  # measured with a short TTL; LiteLLM's default slot TTL is 3600 s

# LiteLLM-style: a sorted set of slot ids scored by their expiry
ZSET_ACQUIRE = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[4])
  return 1
end
return 0
"""


@dataclass
class ShareFigures:
    share_ns: float
    local_ns: float
    zset_ns: float
    ours_lost_s: float
    theirs_lost_s: float
    shift_s: float
    ops_idle: float
    ops_busy: float


def _limit(segment: str) -> int:
    from shm_layout.errors import SegmentError
    from shm_layout.view import read_view

    try:
        view = read_view(segment)
    except SegmentError:
        return -1
    for p in view.providers:
        if p.id == "p1":
            return int(p.effective_limit)
    return -1


def _wait(what: str, predicate: Callable[[], bool], timeout: float = 30.0) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return time.monotonic() - began
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


class _Demand:
    """``n`` threads of this process, each holding a slot of ``segment`` until stopped."""

    def __init__(self, segment: str, n: int) -> None:
        from handler_shim import Admission, AdmissionError

        self.adm = Admission.attach(segment=segment, generation="bench-share")
        self.stop = threading.Event()

        def hold() -> None:
            while not self.stop.is_set():
                try:
                    with self.adm.slot_blocking("p1", timeout=0.2):
                        self.stop.wait()
                except AdmissionError:  # timed out, queue full, or closed at the end
                    pass

        self.threads = [threading.Thread(target=hold, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        self.adm.close()


def _evalsha_calls(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(
        int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
    )


def run_share(cleanup: Cleanup, log: Callable[[str], None], iterations: int) -> ShareFigures:
    client = start_redis(cleanup)
    cleanup.push("redis client", client.close)
    port = client.connection_pool.connection_kwargs["port"]
    tmp = cleanup.tempdir()
    key_file = os.path.join(tmp, "farm.key")
    with open(key_file, "w", encoding="ascii") as f:
        f.write("sk-bench-" + uuid.uuid4().hex + "\n")
    os.chmod(key_file, 0o600)
    farm = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "capacity_farm.py"), "--key-file", key_file],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    cleanup.popen(farm)
    assert farm.stdout is not None
    farm_port = int(farm.stdout.readline())
    segments, sidecars = [], []
    for n in range(4):  # three in share mode, and one in local mode for the slot's cost
        segment = cleanup.segment(new_segment_name())
        config = os.path.join(tmp, f"gw{n}.json")
        share = {"redis": f"redis://127.0.0.1:{port}/0", "gateway": f"gw{n}", "lease": LEASE_S}
        doc: dict[str, Any] = {
            "providers": [
                {
                    "id": "p1",
                    "baseUrl": f"http://127.0.0.1:{farm_port}/v1",
                    "credentialFile": key_file,
                    "capacityDiscovery": True,
                    "models": {"m": "bench-upstream"},
                }
            ],
        }
        if n < 3:
            doc["capacityShare"] = share
        with open(config, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        with open(os.path.join(tmp, f"gw{n}.log"), "wb") as err:
            proc = subprocess.Popen(
                [EXE, "sidecar", "--config", config, "--segment", segment, "--refresh", "0.5"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        cleanup.popen(proc)
        segments.append(segment)
        sidecars.append(proc)
    local_segment = segments.pop()
    _wait("three shares", lambda: all(_limit(s) >= 1 for s in segments))
    _wait("the local gateway", lambda: _limit(local_segment) == SLOTS)
    log("share: three gateways hold their floor")

    # per-request cost: the local slot in share mode, and a per-request Redis semaphore
    from handler_shim import Admission

    shared = Admission.attach(segment=segments[0], generation="bench-share")
    cleanup.push("admission", shared.close)
    local = Admission.attach(segment=local_segment, generation="bench-share")
    cleanup.push("admission", local.close)
    per_round: dict[str, list[float]] = {"share": [], "local": []}
    rounds = 7
    for r in range(rounds + 1):  # interleaved; the first round warms up
        for name, adm in (("share", shared), ("local", local))[:: 1 if r % 2 else -1]:
            t0 = perf_counter_ns()
            for _ in range(iterations // rounds):
                with adm.slot_blocking("p1"):
                    pass
            if r:
                per_round[name].append((perf_counter_ns() - t0) / (iterations // rounds))
    share_ns, local_ns = median(per_round["share"]), median(per_round["local"])
    acquire = client.register_script(ZSET_ACQUIRE)
    zkey = "litellm-style:p1"
    zn = max(1000, iterations // 20)  # a round trip each way: far fewer suffice
    t0 = perf_counter_ns()
    for i in range(zn):
        member = f"req-{i}"
        if not acquire(keys=[zkey], args=[time.time(), SLOTS, 3600, member]):
            raise RuntimeError("zset semaphore full")
        client.zrem(zkey, member)
    zset_ns = (perf_counter_ns() - t0) / zn
    log(f"share: per request {share_ns:.0f} ns, local {local_ns:.0f} ns, zset {zset_ns:.0f} ns")

    # ops/s per gateway, idle
    calls0, t0s = _evalsha_calls(client), time.monotonic()
    time.sleep(3 * LEASE_S)
    ops_idle = (_evalsha_calls(client) - calls0) / (time.monotonic() - t0s) / 3

    # demand on gw0; then a shift to gw1
    d0 = _Demand(segments[0], 10)
    _wait("gw0 grows", lambda: _limit(segments[0]) == SLOTS - 2)
    calls0, t0s = _evalsha_calls(client), time.monotonic()
    d1 = _Demand(segments[1], 10)
    d0.end()
    shift_s = _wait("gw1 grows", lambda: _limit(segments[1]) == SLOTS - 2)
    ops_busy = (_evalsha_calls(client) - calls0) / (time.monotonic() - t0s) / 3
    log(f"share: a demand shift moved capacity in {shift_s:.2f} s")

    # a crash: gw1 holds 4 (running), gw0 asks for more; gw1's sidecar and handlers die
    d0 = _Demand(segments[0], 10)
    time.sleep(0.5)
    if _limit(segments[0]) != 1:  # gw1's limit drops, but its 4 running stay reserved
        raise RuntimeError("expected gw0 at its floor while gw1 runs the rest")
    killed = time.monotonic()
    os.kill(sidecars[1].pid, signal.SIGKILL)
    d1.end()  # its handlers are gone too: nothing of gw1 runs any more
    _wait("gw0 gets gw1's share", lambda: _limit(segments[0]) == SLOTS - 1, timeout=LEASE_S * 10)
    ours_lost_s = time.monotonic() - killed
    d0.end()
    stop_popen(sidecars[1])

    # theirs: a worker takes every slot and dies; how long until one can be taken again
    lost_key = "litellm-style:crash"
    for i in range(SLOTS):
        acquire(keys=[lost_key], args=[time.time(), SLOTS, THEIR_TTL_S, f"dead-{i}"])
    crashed = time.monotonic()
    while not acquire(keys=[lost_key], args=[time.time(), SLOTS, THEIR_TTL_S, "new"]):
        time.sleep(0.01)
    theirs_lost_s = time.monotonic() - crashed
    log(f"share: crash lost {ours_lost_s:.2f} s ours, {theirs_lost_s:.2f} s theirs (TTL)")
    return ShareFigures(
        share_ns, local_ns, zset_ns, ours_lost_s, theirs_lost_s, shift_s, ops_idle, ops_busy
    )
