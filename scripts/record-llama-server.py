"""Record what a real llama-server answers, for the replays that `make test` runs.

Starts the llama-server that scripts/build-llama-server built (GWCAP_LLAMA_SERVER) on
loopback in the shapes the router reads (one model with --parallel 2; the same with
--api-key-file; router mode with --models-dir, before and after a model is loaded),
asks each endpoint the router asks, and writes one fixture per shape under
tests/router/fixtures/ (`kind: recorded`, the server's build info as its version), in
the format tests/router/test_router_fixtures.py replays. `make real-workers` runs it.

    python scripts/record-llama-server.py [OUT_DIR]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # gwtest
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "real"))

from llama import ROOT, LlamaServer, binary, tiny_model
from recording import answers, write_fixture

SDIST = "llama.cpp vendored by the llama-cpp-python 0.3.36 sdist (PyPI)"


def record_small_slots(out: Path, work: Path, model: Path, version: str) -> None:
    """``-c 512 --parallel 2``: 256 tokens a slot, the token proof's slot, read while a stream
    holds one slot where it can be caught (the tiny model is fast), else idle."""
    import threading

    server = LlamaServer(["-m", str(model), "-c", "512", "--parallel", "2"], work / "c512.log")
    try:
        server.wait_healthy()
        alias = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        paths = ["/health", "/props", "/slots", "/v1/models"]
        stop = threading.Event()

        def keep_one_busy() -> None:
            while not stop.is_set():
                httpx.post(
                    server.url + "/completion",
                    json={"prompt": "a", "n_predict": 240, "ignore_eos": True},
                    timeout=60,
                )

        busy = threading.Thread(target=keep_one_busy, daemon=True)
        busy.start()
        got = answers(server.url, paths)
        for _ in range(200):
            if any(s.get("is_processing") for s in got["/slots"]["json"]):
                break
            got = answers(server.url, paths)
        stop.set()
        busy.join(60)
        n_busy = sum(bool(s.get("is_processing")) for s in got["/slots"]["json"])
        write_fixture(
            out,
            "llama-server-c512-parallel2",
            "llama.cpp llama-server (-m tiny.gguf -c 512 --parallel 2, no unified KV cache)",
            version,
            [
                "recorded from a real llama-server by scripts/record-llama-server.py",
                "tools/server/server-context.cpp server_slot: n_ctx is the context a slot "
                "(llama_n_ctx_seq: n_ctx / n_seq_max without kv_unified); model meta "
                "n_ctx is llama_n_ctx, the whole context",
            ],
            registry={"models": [alias], "slots": {"source": "llama-server"}},
            answers=got,
            expect={
                "rows": {alias: 2},
                "complete": True,
                "unserved": [],
                "activity": f"{n_busy} of 2 slots busy",
                "tokens": {alias: [256, 512]},
            },
        )
    finally:
        server.stop()


def main(argv: list[str]) -> int:
    if binary() is None:
        print(
            "record-llama-server: set GWCAP_LLAMA_SERVER (make real-workers does)", file=sys.stderr
        )
        return 2
    out = Path(argv[0]) if argv else ROOT / "tests" / "router" / "fixtures"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = tiny_model(work)
        single = ["/health", "/props", "/v1/models"]
        plain = LlamaServer(["-m", str(model), "--parallel", "2"], work / "plain.log")
        try:
            plain.wait_healthy()
            build = httpx.get(plain.url + "/props", timeout=10).json().get("build_info", "unknown")
            version = f"{SDIST}, build {build}"
            alias = httpx.get(plain.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            write_fixture(
                out,
                "llama-server-recorded",
                "llama.cpp llama-server (-m tiny.gguf --parallel 2)",
                version,
                ["recorded from a real llama-server by scripts/record-llama-server.py"],
                registry={"models": [alias, "typo-model"], "slots": {"source": "llama-server"}},
                answers=answers(plain.url, single),
                expect={  # one model: it answers any id, so the typo counts (warned)
                    "rows": {alias: 2, "typo-model": 2},
                    "complete": True,
                    "unserved": [],
                    "unlisted": ["typo-model"],
                },
            )
        finally:
            plain.stop()
        record_small_slots(out, work, model, version)
        keyfile = work / "key"
        keyfile.write_text("recorded-test-key\n")
        keyfile.chmod(0o600)
        keyed = LlamaServer(
            ["-m", str(model), "--parallel", "2", "--api-key-file", str(keyfile)],
            work / "keyed.log",
        )
        try:
            keyed.wait_healthy()
            write_fixture(
                out,
                "llama-server-api-key-recorded",
                "llama.cpp llama-server (--api-key-file), asked without the key",
                version,
                ["recorded from a real llama-server by scripts/record-llama-server.py"],
                registry={"models": [alias], "slots": {"source": "llama-server"}},
                answers=answers(keyed.url, single),
                expect={"rows": {}, "complete": False, "unserved": []},
            )
        finally:
            keyed.stop()
        models = work / "models"
        models.mkdir()
        tiny_model(models, "tiny-a")
        tiny_model(models, "tiny-b")
        router = LlamaServer(
            [
                "--models-dir",
                str(models),
                "--models-max",
                "2",
                "--parallel",
                "3",
                "--no-models-autoload",
            ],
            work / "router.log",
        )
        routed = [
            "/health",
            "/props",
            "/models",
            "/props?model=tiny-a&autoload=false",
            "/props?model=tiny-b&autoload=false",
        ]
        follows = [
            "recorded from a real llama-server router (--models-dir, --parallel 3)"
            " by scripts/record-llama-server.py"
        ]

        def record_router(name: str, what: str, rows: dict[str, int]) -> None:
            write_fixture(
                out,
                f"llama-server-router-{name}-recorded",
                f"llama.cpp llama-server router mode, {what}",
                version,
                follows,
                registry={
                    "models": ["tiny-a", "tiny-b"],
                    "slots": {"source": "llama-server-router"},
                },
                answers=answers(router.url, routed),
                expect={"rows": rows, "complete": True, "unserved": []},
            )

        try:
            router.wait_healthy()
            record_router("unloaded", "nothing loaded", {"tiny-a": 0, "tiny-b": 0})
            httpx.post(router.url + "/models/load", json={"model": "tiny-a"}, timeout=30)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                states = {
                    m["id"]: m["status"]["value"]
                    for m in httpx.get(router.url + "/models").json()["data"]
                }
                if states.get("tiny-a") == "loaded":
                    break
                time.sleep(0.2)
            record_router("loaded", "tiny-a loaded", {"tiny-a": 3, "tiny-b": 0})
        finally:
            router.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
