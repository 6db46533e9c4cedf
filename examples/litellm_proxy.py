"""LiteLLM's proxy with one admission budget for all its workers: the recipe of docs/litellm.md.

    GATEWAY_CONFIG=/etc/gateway/gateway.json CONFIG_FILE_PATH=litellm.yaml \\
        LITELLM_MASTER_KEY=sk-... GATEWAY_GENERATION=litellm-1 \\
        uvicorn --workers 4 --app-dir examples litellm_proxy:app

LiteLLM's own ``max_parallel_requests`` is counted per worker process (and per
generation during an upgrade); here every worker, and every other gateway on the host
that admits through gateway-capacity, draws on one budget per provider with no Redis.
The request's model (a LiteLLM ``model_name``, read where LiteLLM reads it: the path of
its Azure- and engine-style routes or the query string, else the form or JSON body) is
looked up in the gateway config's ``models`` maps: name each LiteLLM ``model_name`` there
as an alias of the provider that serves it (``"models": {"local-workhorse": "workhorse"}``).
An inference request whose model cannot be read is refused 400;
``ByModel(default="<provider>")`` in place of ``by_model`` admits such requests on that
provider instead (docs/litellm.md).

Environment (read in each worker process): ``GATEWAY_CONFIG`` (required),
``GATEWAY_GENERATION`` (default ``litellm``), ``GATEWAY_ADMISSION_TIMEOUT`` (seconds a
request may wait for a slot, 30), ``GATEWAY_CAPACITY_SEGMENT``; LiteLLM's own
(``CONFIG_FILE_PATH``, ``LITELLM_MASTER_KEY``...) as usual.
"""

from __future__ import annotations

import os

from litellm.proxy.proxy_server import app as litellm_app

from handler_shim.asgi import AdmissionMiddleware, by_model

try:
    CONFIG = os.environ["GATEWAY_CONFIG"]
except KeyError:
    raise SystemExit("litellm_proxy: set GATEWAY_CONFIG to the gateway's config file") from None

app = AdmissionMiddleware(
    litellm_app,
    config=CONFIG,
    generation=lambda: os.environ.get("GATEWAY_GENERATION", "litellm"),
    provider=by_model,
    timeout=float(os.environ.get("GATEWAY_ADMISSION_TIMEOUT", "30")),
)
