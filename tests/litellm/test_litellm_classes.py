"""The LiteLLM callback takes a request's admission class from the key's metadata, else the
team's (R-A22, docs/litellm.md), with LiteLLM's own ``UserAPIKeyAuth``: on a limit of 2
with an interactive reserve of 1, a batch key's second request waits while an interactive
team's is admitted at once."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from gwtest import ROOT

MISSING = [m for m in ("litellm", "fastapi") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}")


def test_r_a22_the_callback_reads_the_class_from_key_then_team_metadata(
    tmp_path: Path, segment_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    classes = [{"name": "interactive", "reserve": 1}, {"name": "batch"}]
    config = tmp_path / "gateway.json"
    config.write_text(
        json.dumps(
            {"providers": [{"id": "p1", "maxConcurrent": 2, "classes": classes,
                            "models": {"local-workhorse": "workhorse"}}]}
        )
    )  # fmt: skip
    monkeypatch.setenv("GATEWAY_CONFIG", str(config))
    monkeypatch.setenv("GATEWAY_CAPACITY_SEGMENT", segment_name)
    spec = importlib.util.spec_from_file_location(
        "litellm_admission", ROOT / "examples" / "litellm_admission.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from litellm.proxy._types import UserAPIKeyAuth

    batch = UserAPIKeyAuth(api_key="sk-b", metadata={"admission_class": "batch"})
    team = UserAPIKeyAuth(api_key="sk-i", team_metadata={"admission_class": "interactive"})
    assert module.admission_class(batch) == "batch"
    assert module.admission_class(team) == "interactive"
    assert module.admission_class(UserAPIKeyAuth(api_key="sk-x")) is None
    hook = module.GatewayCapacityAdmission(timeout=5.0)

    async def main() -> list[str]:
        order: list[str] = []

        async def call(who: Any, call_id: str) -> None:
            data = {"model": "local-workhorse", "litellm_call_id": call_id}
            await hook.async_pre_call_hook(who, None, data, "completion")
            order.append(call_id)

        await call(batch, "b1")
        second = asyncio.ensure_future(call(batch, "b2"))
        await asyncio.sleep(0.3)
        assert order == ["b1"]  # the second batch request waits behind the reserve
        await call(team, "i1")  # admitted at once
        await hook.async_log_success_event({"litellm_call_id": "b1"}, None, None, None)
        await asyncio.wait_for(second, 5)
        for cid in ("b2", "i1"):
            await hook.async_log_success_event({"litellm_call_id": cid}, None, None, None)
        return order

    try:
        assert asyncio.run(main()) == ["b1", "i1", "b2"]
    finally:
        if hook._adm is not None:
            hook._adm.close()
        if module.proxy_handler_instance._adm is not None:
            module.proxy_handler_instance._adm.close()
    assert os.environ["GATEWAY_CONFIG"] == str(config)
