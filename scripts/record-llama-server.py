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

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.real.llama import ROOT, LlamaServer, binary, tiny_model

SDIST = "llama.cpp vendored by the llama-cpp-python 0.3.36 sdist (PyPI)"


def _answers(server: LlamaServer, paths: list[str], key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out: dict[str, Any] = {}
    for path in paths:
        answer = httpx.get(server.url + path, headers=headers, timeout=30.0)
        try:
            out[path] = {"status": answer.status_code, "json": answer.json()}
        except ValueError:
            out[path] = {"status": answer.status_code, "text": answer.text}
        print(f"  GET {path} -> {answer.status_code}")
    return out


def _write(out: Path, name: str, server: str, version: str, follows: list[str], **doc: Any) -> None:
    record = {
        "server": server,
        "version": f"{SDIST}, build {version}",
        "kind": "recorded",
        "follows": follows,
        **doc,
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {name}.json")


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
            version = str(
                httpx.get(plain.url + "/props", timeout=10).json().get("build_info", "unknown")
            )
            alias = httpx.get(plain.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            _write(
                out,
                "llama-server-recorded",
                "llama.cpp llama-server (-m tiny.gguf --parallel 2)",
                version,
                ["recorded from a real llama-server by scripts/record-llama-server.py"],
                registry={"models": [alias, "typo-model"], "slots": {"source": "llama-server"}},
                answers=_answers(plain, single, None),
                expect={  # one model: it answers any id, so the typo counts (warned)
                    "rows": {alias: 2, "typo-model": 2},
                    "complete": True,
                    "unserved": [],
                    "unlisted": ["typo-model"],
                },
            )
        finally:
            plain.stop()
        keyfile = work / "key"
        keyfile.write_text("recorded-test-key\n")
        keyfile.chmod(0o600)
        keyed = LlamaServer(
            ["-m", str(model), "--parallel", "2", "--api-key-file", str(keyfile)],
            work / "keyed.log",
        )
        try:
            keyed.wait_healthy()
            _write(
                out,
                "llama-server-api-key-recorded",
                "llama.cpp llama-server (--api-key-file), asked without the key",
                version,
                ["recorded from a real llama-server by scripts/record-llama-server.py"],
                registry={"models": [alias], "slots": {"source": "llama-server"}},
                answers=_answers(keyed, single, None),
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
        try:
            router.wait_healthy()
            _write(
                out,
                "llama-server-router-unloaded-recorded",
                "llama.cpp llama-server router mode, nothing loaded",
                version,
                follows,
                registry={
                    "models": ["tiny-a", "tiny-b"],
                    "slots": {"source": "llama-server-router"},
                },
                answers=_answers(router, routed, None),
                expect={"rows": {"tiny-a": 0, "tiny-b": 0}, "complete": True, "unserved": []},
            )
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
            _write(
                out,
                "llama-server-router-loaded-recorded",
                "llama.cpp llama-server router mode, tiny-a loaded",
                version,
                follows,
                registry={
                    "models": ["tiny-a", "tiny-b"],
                    "slots": {"source": "llama-server-router"},
                },
                answers=_answers(router, routed, None),
                expect={"rows": {"tiny-a": 3, "tiny-b": 0}, "complete": True, "unserved": []},
            )
        finally:
            router.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
