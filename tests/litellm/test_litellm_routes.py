"""``by_model`` reads the model where LiteLLM's proxy reads it, against the real ``litellm``
package (SPEC section 8; R-A1 per provider, R-C2 aliases).

LiteLLM takes the model from the path of its Azure- and engine-style routes (where the path
wins over the body) and parses form bodies; ``handler_shim.model_routes.LITELLM`` mirrors
those rules. Here: the table against LiteLLM's own router, then LiteLLM's proxy wrapped as
in ``examples/litellm_proxy.py`` with a provider limit of 1, three concurrent requests per
route shape held 2 s by the upstream, which counts how many it held at once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from gwtest import ROOT, run_cli
from litellm_support import (
    ALIAS,
    PROVIDER,
    UPSTREAM_MODEL,
    HoldingUpstream,
    StartServed,
    skip_without_litellm,
)

from handler_shim.model_routes import LITELLM, match

skip_without_litellm()

EXAMPLES = ROOT / "examples"
OTHER = "other-inference"
OTHER_ALIAS = "other-alias"  # another provider's LiteLLM model_name

# LiteLLM's router, walked in its order of matching: each POST route's template, endpoint
# name and the path parameters its regex takes from a probe path.
ROUTER_PROBE = """
import json, os, sys
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_TELEMETRY"] = "False"
from litellm.proxy.proxy_server import app

def walk(routes):
    for r in routes:
        if type(r).__name__ == "_IncludedRouter":
            yield from walk(r.original_router.routes)
        elif "POST" in (getattr(r, "methods", None) or ()):
            yield r

routes = list(walk(app.routes))
answers = {}
for path in json.load(sys.stdin):
    hit = next((r for r in routes if r.path_regex.match(path)), None)
    answers[path] = None if hit is None else [
        hit.path, hit.name, hit.path_regex.match(path).groupdict()
    ]
def params(r, kind):
    return [p.name for p in getattr(r.dependant, kind)]

templates = [[r.path, params(r, "path_params"), params(r, "query_params")] for r in routes]
print(json.dumps({"answers": answers, "templates": templates}))
"""


def probe_paths() -> list[str]:
    paths = ["/v1/models", "/key/generate", "/v1/traces", "/v1/chat/completions/"]
    paths += ["/engines/a/chat/completions/chat/completions", "/engines/a/embeddings/completions"]
    paths += ["/openai/deployments/x/images/generations/chat/completions"]
    for r in LITELLM:
        for model in ("m", "a/b", "", "x:generateContent"):
            paths.append(re.sub(r"\{[^}]*\}", model, r.template))
    return paths


@pytest.mark.timeout(120)  # LiteLLM's import is seconds of CPU
def test_the_litellm_table_matches_litellms_own_router_in_its_order() -> None:
    paths = probe_paths()
    out = subprocess.run(
        [sys.executable, "-c", ROUTER_PROBE],
        input=json.dumps(paths),
        capture_output=True,
        text=True,
        timeout=110,
        check=True,
    )
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    ours_templates = {r.template for r in LITELLM}
    for path in paths:
        real = doc["answers"][path]
        ours = match(LITELLM, "POST", path)
        if ours is None:
            assert real is None or real[0] not in ours_templates, (path, real)
            continue
        assert real is not None, path
        template, _name, params = real
        assert ours[0].template == template, (path, real)
        if ours[0].path_model is not None:
            assert params[ours[0].path_model] == ours[1], (path, params)
    # every POST route of LiteLLM whose path or query string carries a model is in the
    # table, with the same parameter
    carried = {
        t: (
            next((p for p in path if p.startswith("model")), None),
            "model" if "model" in query else None,
        )
        for t, path, query in doc["templates"]
        if not t.endswith(":countTokens")
    }
    carried = {t: names for t, names in carried.items() if names != (None, None)}
    ours = {r.template: (r.path_model, r.query_model) for r in LITELLM}
    assert {t: ours.get(t) for t in carried} == carried


def routes_yaml(directory: Path, upstream: HoldingUpstream) -> Path:
    entries = [(ALIAS, UPSTREAM_MODEL), (OTHER_ALIAS, "other-model")]
    lines = ["model_list:"]
    for name, model in entries:
        lines += [
            f"  - model_name: {name}",
            "    litellm_params:",
            f"      model: openai/{model}",
            f"      api_base: {upstream.base}",
            "      api_key: sk-upstream",
            "      num_retries: 0",
        ]
    path = directory / "litellm.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def limit_one_config(directory: Path, upstream: HoldingUpstream, key_file: Path) -> Path:
    """The provider LiteLLM serves ``local-workhorse`` from, limit 1, and another
    provider (limit 8) whose alias a client may put in the body."""
    path = directory / "gateway-routes.json"
    common = {"baseUrl": upstream.base, "credentialFile": str(key_file)}
    providers = [
        {"id": PROVIDER, "maxConcurrent": 1, "models": {ALIAS: UPSTREAM_MODEL}, **common},
        {"id": OTHER, "maxConcurrent": 8, "models": {OTHER_ALIAS: "other-model"}, **common},
    ]
    path.write_text(json.dumps({"providers": providers}))
    return path


@pytest.fixture
def limit_one_proxy(
    serve: StartServed,
    upstream: HoldingUpstream,
    tmp_path: Path,
    master_key: str,
    key_file: Path,
) -> Any:
    env = {
        "CONFIG_FILE_PATH": str(routes_yaml(tmp_path, upstream)),
        "LITELLM_MASTER_KEY": master_key,
        "GATEWAY_CONFIG": str(limit_one_config(tmp_path, upstream, key_file)),
    }
    return serve("litellm_proxy:app", EXAMPLES, env=env)


def provider_counters(segment: str) -> dict[str, dict[str, int]]:
    doc = json.loads(run_cli("inspect", "--segment", segment, "--json").stdout)
    return {p["id"]: p["counters"] for p in doc["providers"]}


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.timeout(300)  # LiteLLM's import alone is seconds of CPU
def test_r_a1_by_model_holds_every_litellm_route_shape_to_the_limit_of_the_provider_served(
    limit_one_proxy: Any, upstream: HoldingUpstream, master_key: str, segment_name: str
) -> None:
    proxy = limit_one_proxy
    azure = f"/openai/deployments/{ALIAS}/chat/completions"
    shapes: dict[str, tuple[str, dict[str, Any]]] = {
        "json route": ("/v1/chat/completions", {"json": {"model": ALIAS, "messages": MESSAGES}}),
        "azure path, no body model": (azure, {"json": {"messages": MESSAGES}}),
        "azure path, another provider's alias in the body": (
            azure,
            {"json": {"model": OTHER_ALIAS, "messages": MESSAGES}},
        ),
        "json route, the alias in the query, another provider's in the body": (
            f"/v1/chat/completions?model={ALIAS}",
            {"json": {"model": OTHER_ALIAS, "messages": MESSAGES}},
        ),
        "engine path, form body": (
            f"/engines/{ALIAS}/completions",
            {"data": {"prompt": "hi"}},
        ),
        "form-encoded /v1/completions": (
            "/v1/completions",
            {"data": {"model": ALIAS, "prompt": "hi"}},
        ),
    }
    auth = {"Authorization": f"Bearer {master_key}"}
    upstream.hold = 2.0
    peaks: dict[str, int] = {}
    statuses: dict[str, list[int]] = {}
    for shape, (path, body) in shapes.items():
        upstream.reset_peak()
        with ThreadPoolExecutor(3) as pool:
            answers = [
                pool.submit(httpx.post, proxy.base + path, headers=auth, timeout=60, **body)
                for _ in range(3)
            ]
            statuses[shape] = [a.result().status_code for a in answers]
        peaks[shape] = upstream.peak
    assert peaks == dict.fromkeys(shapes, 1), peaks
    assert statuses == {shape: [200] * 3 for shape in shapes}, statuses
    assert set(upstream.models) == {UPSTREAM_MODEL}  # LiteLLM served the path's model
    counters = provider_counters(segment_name)
    assert counters[PROVIDER]["admitted_total"] == 3 * len(shapes)
    assert counters[PROVIDER]["peak_running"] == 1
    assert counters[OTHER]["admitted_total"] == 0


@pytest.mark.timeout(300)  # LiteLLM's import alone is seconds of CPU
def test_by_model_refuses_a_litellm_inference_request_whose_model_cannot_be_read_400(
    limit_one_proxy: Any, upstream: HoldingUpstream, master_key: str, segment_name: str
) -> None:
    proxy = limit_one_proxy
    auth = {"Authorization": f"Bearer {master_key}"}
    unreadable: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"json": {"messages": MESSAGES}}),
        ("/v1/chat/completions", {"json": {"model": ["a", ALIAS], "messages": MESSAGES}}),
        ("/engines//chat/completions", {"json": {"messages": MESSAGES}}),
        ("/v1/completions", {"data": {"prompt": "hi"}}),
        ("/v1/embeddings", {"content": b"", "headers": {"Content-Type": "application/json"}}),
        ("/v1/audio/transcriptions", {"files": {"file": ("a.wav", b"RIFF")}}),
        (
            "/v1/audio/transcriptions",  # LiteLLM makes a list of model[]
            {"files": {"file": ("a.wav", b"RIFF")}, "data": {"model": ALIAS, "model[]": ALIAS}},
        ),
    ]
    for path, body in unreadable:
        headers = {**auth, **body.pop("headers", {})}
        answer = httpx.post(proxy.base + path, headers=headers, timeout=60, **body)
        assert answer.status_code == 400, (path, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "model_required" and error["type"] == "invalid_request_error"
    bad_form = httpx.post(
        proxy.base + "/v1/audio/transcriptions",
        headers={**auth, "Content-Type": "multipart/form-data; boundary=x"},
        content=b"--x\r\nContent-Disposition: form-data\r\n\r\nno name\r\n--x--\r\n",
        timeout=60,
    )
    assert bad_form.status_code == 400 and bad_form.json()["error"]["code"] == "invalid_form"
    assert upstream.seen == 0
    assert provider_counters(segment_name)[PROVIDER]["admitted_total"] == 0
    # what LiteLLM itself answers is untouched: its model list, its health
    models = httpx.get(proxy.base + "/v1/models", headers=auth, timeout=60)
    assert models.status_code == 200
    assert {m["id"] for m in models.json()["data"]} == {ALIAS, OTHER_ALIAS}
