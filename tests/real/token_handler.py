"""One handler process of the token scenario (token_load.py), run with the product's python.

    python token_handler.py PLAN.json

It attaches to the gateway's segment as a handler generation of its own, says ready,
and once the parent says go (a line on stdin) runs the plan's requests on a few threads,
each one in turn: admission (``slot_blocking``, charged the request's tokens when the plan
says so), then a streamed ``/v1/completions`` through the reference router to the real
server. One JSON line per request on stdout: when it
arrived, was admitted, saw its first token and ended, and how it ended.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from typing import Any

import httpx

from handler_shim import Admission


def charge_of(request: dict[str, Any]) -> int:
    """What admission charges a request: its prompt's tokens (token ids here, so the count
    is exact) and its ``max_tokens``."""
    return len(request["prompt"]) + int(request["max_tokens"])


def run_one(
    adm: Admission, plan: dict[str, Any], client: httpx.Client, request: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {"id": request["id"], "kind": request["kind"], "pid": os.getpid()}
    out["arrived"] = time.time()
    body = {
        "model": plan["model"],
        "prompt": request["prompt"],
        "max_tokens": request["max_tokens"],
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    tokens = charge_of(request) if plan["charge"] else 0  # 0: slots alone
    try:
        with adm.slot_blocking(plan["provider"], timeout=plan["admission_timeout"], tokens=tokens):
            out["admitted"] = time.time()
            with client.stream("POST", "/v1/completions", json=body) as answer:
                if answer.status_code != 200:
                    out["error"] = f"HTTP {answer.status_code}: {answer.read()[:300]!r}"
                    return out
                for line in answer.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and "first" not in out:
                        out["first"] = time.time()
                    if chunk.get("usage"):
                        out["usage"] = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        if choice.get("finish_reason"):
                            out["finish"] = choice["finish_reason"]
            out["ended"] = time.time()  # before the slot and its tokens are released
    except Exception as exc:  # reported for the scenario's assertions, not raised
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def main(plan_path: str) -> int:
    with open(plan_path) as f:
        plan = json.load(f)
    adm = Admission.attach(
        config=plan["config"], segment=plan["segment"], generation=plan["generation"]
    )
    todo: queue.Queue[dict[str, Any]] = queue.Queue()
    for request in plan["requests"]:
        todo.put(request)
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {plan['router_key']}"}
    print(json.dumps({"ready": os.getpid()}), flush=True)
    sys.stdin.readline()  # the parent's go, once every handler is attached

    def thread() -> None:
        with httpx.Client(
            base_url=plan["router_url"], headers=headers, timeout=600, trust_env=False
        ) as client:
            while True:
                try:
                    request = todo.get_nowait()
                except queue.Empty:
                    return
                line = json.dumps(run_one(adm, plan, client, request))
                with lock:
                    print(line, flush=True)

    threads = [threading.Thread(target=thread) for _ in range(plan["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    adm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
