"""The LiteLLM callback (``examples/litellm_admission.py``) charges each completion its
tokens by the middleware's one estimate, and refuses at once one that no worker could hold
(R-T1, R-T2), against the real ``litellm`` package under real uvicorn."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from gwtest import ROOT, availability, publish_token_budget, wait_until
from litellm_support import (
    ALIAS,
    PROVIDER,
    HoldingUpstream,
    StartServed,
    litellm_yaml,
    skip_without_litellm,
)

from handler_shim import Admission

skip_without_litellm()

EXAMPLES = ROOT / "examples"


def post(base: str, key: str, content: str, max_tokens: int) -> httpx.Response:
    body = {
        "model": ALIAS,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
    }
    return httpx.post(
        f"{base}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def provider(segment: str) -> dict[str, Any]:
    return next(p for p in availability(segment)["providers"] if p["id"] == PROVIDER)


@pytest.mark.timeout(300)  # LiteLLM's import alone is seconds of CPU per worker
def test_r_t2_the_litellm_callback_charges_tokens_and_refuses_what_no_worker_holds(
    serve: StartServed,
    upstream: HoldingUpstream,
    tmp_path: Path,
    master_key: str,
    segment_name: str,
    gateway_config: Path,
) -> None:
    litellm_dir = tmp_path / "litellm"
    litellm_dir.mkdir()
    shutil.copy(EXAMPLES / "litellm_admission.py", litellm_dir)
    config = litellm_yaml(litellm_dir, upstream, callback=True)
    litellm = serve(
        "litellm.proxy.proxy_server:app",
        litellm_dir,
        env={"CONFIG_FILE_PATH": str(config), "LITELLM_MASTER_KEY": master_key},
    )
    adm = Admission.attach(config=gateway_config, segment=segment_name)
    try:
        publish_token_budget(adm, limit=2, tokens=1000, per_request=300, provider=PROVIDER)
        refused = post(litellm.base, master_key, "word " * 400, 50)  # about 500 tokens and 50
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["message"].startswith("context_length_exceeded: "), error
        assert "300" in error["message"], error  # the most one request may hold, named
        assert upstream.seen == 0  # never sent to fail on the server

        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(post, litellm.base, master_key, "hi", 100)
            assert wait_until(lambda: provider(segment_name)["running"] == 1, timeout=60)
            charged = provider(segment_name)["tokens_running"]
            assert 100 < charged <= 300, charged  # max_tokens and the prompt's estimate
            upstream.release.set()
            assert held.result().status_code == 200
        assert wait_until(lambda: provider(segment_name)["tokens_running"] == 0, timeout=30)
    finally:
        adm.close()
