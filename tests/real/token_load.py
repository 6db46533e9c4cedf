"""Admission in requests or in tokens in front of a real vLLM whose KV cache is smaller than
its ``--max-num-seqs`` requests of ``--max-model-len`` (the proof on real servers).

The stack, every part a real process as an operator runs it: vLLM (CPU) started
``--max-num-seqs 8 --max-model-len 512 --num-gpu-blocks-override 12`` (12 blocks of 128,
one of them vLLM's null block: 1,408 tokens, of which the router states 512, one request
of 512, for what eight requests may waste to whole blocks), the
reference router in front of it
(``gateway-capacity router serve``, the ``vllm`` source), the sidecar probing the router
and publishing its capacity into a segment, and several handler processes
(token_handler.py) admitting through that segment and relaying to the router.

The load: long requests (256 prompt tokens + 128 generated: 3 blocks) and short ones
(100 + 28: 1 block) in turn, ``ignore_eos``, from ``HANDLERS`` processes of ``THREADS``
threads each (the long ones stay under ``--max-model-len`` by the router's own estimate
too, which counts a body's bytes over four). The prompts are token ids, so a request's
charge (prompt + ``max_tokens``) is exactly what it may hold, and both sizes are whole
blocks, so that a token budget of the pool's size is a block budget too. Run once
without charging tokens (admission on requests alone: 8 run, 16 blocks wanted) and once
charging them; what vLLM's ``/metrics`` says about each run
(``vllm:num_preemptions_total``), completed requests a second and time to first token
(from the handler's arrival, the gateway's queue included) are what the test asserts on
and the figures print.

    python tests/real/token_load.py     # the figures, by hand (GWCAP_VLLM_PYTHON set)
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from capacity_router.sources import admissible_tokens

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # as a script too
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gwtest import free_port, start_sidecar, wait_until
from servers import (
    ROUTER_KEY,
    STARTUP_S,
    RealServer,
    Router,
    start_vllm,
    tiny_model,
    worker_entry,
)

from handler_shim import Admission
from shm_layout.view import read_view

HERE = Path(__file__).resolve().parent

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 512
BLOCK_SIZE = 128  # vLLM's CPU default
GPU_BLOCKS = 12
# What the router states for this vLLM (capacity_router/sources.py, DESIGN.md 6c): vLLM v1
# keeps one of its blocks as a null block it never hands out (v1/core/block_pool.py), so
# 11 blocks of 128 are usable, 1,408 tokens; less what MAX_NUM_SEQS requests may waste to
# whole blocks, but never less than one request of MAX_MODEL_LEN: 512 here
POOL = admissible_tokens(((GPU_BLOCKS, BLOCK_SIZE),), MAX_NUM_SEQS, MAX_MODEL_LEN)
LONG = (256, 128)  # prompt tokens, max_tokens: 3 blocks
SHORT = (100, 28)  # 1 block
VOCAB = 384  # tiny_hf.py's; ids 3.. are ordinary tokens
HANDLERS = 3
THREADS = 4  # 12 requests offered at once: more than MAX_NUM_SEQS
REQUESTS = 24  # half of them long
PROVIDER = "farm"
MODEL = "tiny"
ADMISSION_TIMEOUT = 600.0


def tokens_supported() -> bool:
    """Whether this checkout's admission takes a request's tokens."""
    return "tokens" in inspect.signature(Admission.slot_blocking).parameters


def requests_of(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` requests, long, short, long, ...; random token ids (no two share a prefix
    block, so prefix caching saves nothing)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind, (prompt, max_tokens) = ("long", LONG) if i % 2 == 0 else ("short", SHORT)
        ids = [rng.randrange(3, VOCAB) for _ in range(prompt)]
        out.append({"id": i, "kind": kind, "prompt": ids, "max_tokens": max_tokens})
    return out


def metric(url: str, name: str) -> float:
    from capacity_router.sources import gauge_sum

    value = gauge_sum(httpx.get(f"{url}/metrics", timeout=10).content, name)
    return float(value or 0.0)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (q in 0..100)."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)]


@dataclass
class LoadResult:
    charge: bool
    requests: list[dict[str, Any]]
    preemptions: float
    wall_s: float
    peak_running: float
    peak_kv_usage: float

    @property
    def errors(self) -> list[str]:
        return [f"request {r['id']}: {r['error']}" for r in self.requests if "error" in r]

    @property
    def completed(self) -> int:
        return sum(1 for r in self.requests if r.get("finish") == "length")

    @property
    def per_second(self) -> float:
        return self.completed / self.wall_s

    def ttft_s(self) -> list[float]:
        return [r["first"] - r["arrived"] for r in self.requests if "first" in r]

    def most_tokens_admitted(self) -> int:
        """The most tokens the admitted requests could hold at one moment (by their
        admission and end times as the handlers saw them)."""
        spans = [(r["admitted"], r["ended"], len_of(r)) for r in self.requests if "ended" in r]
        return max((sum(c for s, e, c in spans if s <= t < e) for t, _, _ in spans), default=0)

    def line(self) -> str:
        ttft = self.ttft_s()
        how = "tokens charged" if self.charge else "requests only"
        return (
            f"{how}: {self.completed}/{len(self.requests)} completed in {self.wall_s:.1f} s "
            f"({self.per_second:.2f}/s), vllm:num_preemptions_total +{self.preemptions:g}, "
            f"TTFT p50 {statistics.median(ttft):.2f} s p99 {percentile(ttft, 99):.2f} s, "
            f"vllm running peak {self.peak_running:g}, KV usage peak "
            f"{self.peak_kv_usage:.0%}, most tokens admitted at once "
            f"{self.most_tokens_admitted()}"
        )


def len_of(record: dict[str, Any]) -> int:
    prompt, max_tokens = LONG if record["kind"] == "long" else SHORT
    return prompt + max_tokens


class Gateway:
    """The gateway side: a config of one provider, ``farm``, discovered from ``router``, and
    the sidecar publishing it into a segment of its own."""

    def __init__(self, work: Path, router: Router, models: dict[str, str]) -> None:
        self.work = work
        self.segment = "/gwreal-" + secrets.token_hex(5)
        self.config = work / "gateway.json"
        self.config.write_text(
            json.dumps(
                {
                    "providers": [
                        {
                            "id": PROVIDER,
                            "type": "chat-completions-api",
                            "baseUrl": f"{router.url}/v1",
                            "credentialFile": str(router.key_file),
                            "capacityDiscovery": True,
                            "models": models,
                        }
                    ]
                }
            )
        )
        parent = ("--parent-pid", str(os.getpid()))
        self.sidecar = start_sidecar(
            self.config, self.segment, work / "sidecar.log", *parent, refresh=1
        )

    def row(self) -> Any:
        with suppress(Exception):  # not created yet
            return read_view(self.segment).provider(PROVIDER)
        return None

    def limit(self) -> int | None:
        row = self.row()
        return None if row is None else int(row.effective_limit)

    def token_limit(self) -> int:
        """The token budget the segment holds for the provider (0: none, or a layout
        without one)."""
        return int(getattr(self.row(), "token_limit", 0) or 0)

    def request_token_limit(self) -> int:
        """The most one request may hold, as the segment says (0: unknown)."""
        return int(getattr(self.row(), "request_token_limit", 0) or 0)

    def wait_published(self, check: Callable[[], bool], what: str, timeout: float = 60) -> None:
        if not wait_until(check, timeout, every=0.2):
            tail = (self.work / "sidecar.log").read_text()[-2000:]
            raise AssertionError(f"the sidecar never published {what}: {self.row()}\n{tail}")

    def attach(self, generation: str) -> Admission:
        return Admission.attach(
            config=str(self.config), segment=self.segment, generation=generation
        )

    def stop(self) -> None:
        if self.sidecar.poll() is None:
            self.sidecar.send_signal(signal.SIGTERM)
            try:
                self.sidecar.wait(20)
            except subprocess.TimeoutExpired:
                self.sidecar.kill()
                self.sidecar.wait()
        from shm_layout.segment import unlink_segment

        unlink_segment(self.segment)


class TokenStack:
    """vLLM, the router in front, the gateway; ``run(charge)`` drives one load."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[str]] = []
        self.vllm: RealServer | None = None
        self.router: Router | None = None
        self.gateway: Gateway | None = None
        self.startup_s = 0.0

    def start(self) -> None:
        model = tiny_model("vllm", self.work)
        port = free_port()
        worker = worker_entry(port, [MODEL], {"source": "vllm", "fixed": MAX_NUM_SEQS})
        self.router = Router(self.work, [worker])
        self.vllm = start_vllm(
            model,
            port,
            self.work / "vllm.log",
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=MAX_MODEL_LEN,
            extra=("--num-gpu-blocks-override", str(GPU_BLOCKS)),
        )
        self.startup_s = self.vllm.wait_healthy(STARTUP_S["vllm"])
        router = self.router
        router.wait(lambda: router.rows() == {MODEL: MAX_NUM_SEQS}, "read", 120)
        gateway = self.gateway = Gateway(self.work, router, {MODEL: MODEL})
        gateway.wait_published(lambda: gateway.limit() == MAX_NUM_SEQS, str(MAX_NUM_SEQS))

    def run(self, charge: bool, seed: int = 47) -> LoadResult:
        assert self.vllm is not None and self.router is not None and self.gateway is not None
        gateway = self.gateway
        if charge:
            gateway.wait_published(
                lambda: gateway.token_limit() == POOL, f"a budget of {POOL}", 120
            )
        url = self.vllm.url
        before = metric(url, "vllm:num_preemptions_total")
        requests = requests_of(REQUESTS, seed)
        handlers = []
        for h in range(HANDLERS):
            plan = {
                "config": str(gateway.config),
                "segment": gateway.segment,
                "generation": f"handler-{h}",
                "provider": PROVIDER,
                "model": MODEL,
                "router_url": self.router.url,
                "router_key": ROUTER_KEY,
                "charge": charge,
                "threads": THREADS,
                "admission_timeout": ADMISSION_TIMEOUT,
                "requests": requests[h::HANDLERS],
            }
            path = self.work / f"plan-{int(charge)}-{h}.json"
            path.write_text(json.dumps(plan))
            with (self.work / f"handler-{int(charge)}-{h}.log").open("wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, str(HERE / "token_handler.py"), str(path)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
            self.procs.append(proc)
            handlers.append(proc)
        for proc in handlers:
            assert proc.stdout is not None
            ready = proc.stdout.readline()
            assert ready.startswith('{"ready"'), ready
        from servers import gauge_watch

        names = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")
        with gauge_watch(f"{url}/metrics", names, {}) as top:
            started = time.time()
            for proc in handlers:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            records: list[dict[str, Any]] = []
            for proc in handlers:
                out, _ = proc.communicate(timeout=ADMISSION_TIMEOUT + 300)
                records.extend(json.loads(line) for line in out.splitlines() if line)
            ended = max((r.get("ended", r["arrived"]) for r in records), default=started)
        after = metric(url, "vllm:num_preemptions_total")
        return LoadResult(
            charge,
            sorted(records, key=lambda r: r["id"]),
            after - before,
            ended - started,
            top["vllm:num_requests_running"],
            top["vllm:kv_cache_usage_perc"],
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.gateway is not None:
            self.gateway.stop()
        if self.router is not None:
            self.router.stop()
        if self.vllm is not None:
            self.vllm.stop()


@contextmanager
def token_stack(work: Path) -> Iterator[TokenStack]:
    stack = TokenStack(work)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def main() -> int:
    from servers import python

    if python("vllm") is None:
        print("no vLLM venv: set GWCAP_VLLM_PYTHON (scripts/install-real-server vllm)")
        return 2
    with tempfile.TemporaryDirectory() as tmp, token_stack(Path(tmp)) as stack:
        print(f"vLLM healthy {stack.startup_s:.0f} s after start", flush=True)
        print(stack.run(charge=False).line(), flush=True)
        if tokens_supported():
            print(stack.run(charge=True).line(), flush=True)
        else:
            print("tokens charged: not run (this checkout's admission takes no tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
