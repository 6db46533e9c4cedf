"""Ollama states one request's context per loaded model (``GET /api/ps``
``context_length``, R-K7); where it does not say it for every model the worker serves,
the worker is slots only and ``router show`` says why (tests/router/fixtures: the
figures when it does)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from router_support import Router, ScriptedServer, worker

FIXTURE = Path(__file__).parent / "fixtures" / "ollama-api-ps-fb30760.json"


@pytest.mark.parametrize(
    ("loaded", "why"),
    [
        ([("llama3.2:latest", 8192)], "not stated: not loaded: qwen2.5"),
        ([("llama3.2:latest", 8192), ("qwen2.5:latest", 4096)], "models loaded with different"),
        ([("llama3.2:latest", 8192), ("qwen2.5:latest", 8192)], ""),
    ],
)
def test_r_k7_ollama_states_tokens_only_when_every_model_is_loaded_with_one_context(
    loaded: list[tuple[str, int]],
    why: str,
    scripted: Callable[[], ScriptedServer],
    router: Router,
) -> None:
    answers = json.loads(FIXTURE.read_text())["answers"]
    tags = answers["/api/tags"]["json"]
    chat = tags["models"][0]
    tags["models"].append({**chat, "name": "qwen2.5:latest", "model": "qwen2.5:latest"})
    server = scripted()
    server.route("/", 200, "Ollama is running")
    server.route("/api/tags", 200, json.dumps(tags))
    ps = [{"name": n, "model": n, "context_length": c} for n, c in loaded]
    server.route("/api/ps", 200, json.dumps({"models": ps}))
    r = router(
        [worker("o", [server.url], ["llama3.2", "qwen2.5"], {"source": "ollama", "fixed": 2})]
    )
    snap = r.observe()
    status = r.workers()[0]
    tokens = {m.id: (m.request_tokens, m.running_tokens) for m in snap.models}
    if why:
        assert tokens == {"llama3.2": (None, None), "qwen2.5": (None, None)}
        assert why in status.tokens_from, status.tokens_from
    else:
        assert tokens == {"llama3.2": (8192, 16384), "qwen2.5": (8192, 16384)}
