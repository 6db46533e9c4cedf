"""A LiteLLM proxy callback that admits each completion through gateway-capacity.

The other way in (docs/litellm.md): instead of wrapping LiteLLM's ASGI app in
``AdmissionMiddleware`` (``examples/litellm_proxy.py``), register this
``CustomLogger`` in LiteLLM's config, beside this file::

    litellm_settings:
      callbacks: litellm_admission.proxy_handler_instance

``async_pre_call_hook`` takes a slot (``Admission.acquire``) of the provider whose
``models`` map in the gateway config names the request's ``model`` (a LiteLLM
``model_name``, matched as ``by_model`` matches it); LiteLLM's success and failure
events, and its post-call failure hook, give it back (``Admission.release``, idempotent).
The admission class (docs/classes.md) is the ``admission_class`` of the virtual key's
metadata, else of its team's metadata, else the provider's default class.
The request is charged its tokens (docs/DESIGN.md section 6c) by the middleware's one
estimate (``request_charge``: the prompt's estimate plus ``max_tokens``, or the most one
request may hold when it names none); one that no worker could hold is answered 400 at
once, ``invalid_request_error`` with the numbers (LiteLLM renders the body's ``code`` as
the status; the middleware's ``context_length_exceeded`` leads the message), never queued.
A queue of 32 already waiting is answered 429 and a wait past the timeout 503, both with
``Retry-After`` (the provider's drain estimate). Models no provider names are not
admitted.

Its limits, against the middleware:

- A client that goes away while its request waits in the hook is not seen: the request
  keeps its place until it is granted (and then runs) or times out.
- The slot is held from the hook to LiteLLM's final success or failure event, so it
  covers LiteLLM's own retries and fallbacks of that request (all on the one slot), and,
  for a stream, the whole stream as LiteLLM logs it.
- A request for which LiteLLM logs neither success nor failure (a path that skips its
  logging) would keep its slot: tickets older than ``max_hold_s`` (600 s) are given back
  at the next arrival, with a warning.
- The 429/503 reach the client through LiteLLM's error handling: the status code and the
  body's message are LiteLLM's rendering of the refusal.

Environment (read in each LiteLLM worker process, which attaches on its first request):
``GATEWAY_CONFIG`` (required), ``GATEWAY_GENERATION`` (default ``litellm``),
``GATEWAY_ADMISSION_TIMEOUT`` (30), ``GATEWAY_CAPACITY_SEGMENT``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger

from capacity_contract.tokens import request_charge
from handler_shim import (
    Admission,
    AdmissionError,
    AdmissionTimeout,
    QueueFull,
    RequestTooLarge,
    Ticket,
)
from handler_shim.asgi import ModelMap

log = logging.getLogger("gateway_capacity.litellm")


class GatewayCapacityAdmission(CustomLogger):
    """One shared admission slot per LiteLLM completion, acquired and released in hooks."""

    def __init__(
        self,
        config: str | None = None,
        generation: str | None = None,
        timeout: float | None = None,
        max_hold_s: float = 600.0,
    ) -> None:
        super().__init__()
        self.config = config or os.environ["GATEWAY_CONFIG"]
        self.generation = generation or os.environ.get("GATEWAY_GENERATION", "litellm")
        self.timeout = (
            timeout
            if timeout is not None
            else float(os.environ.get("GATEWAY_ADMISSION_TIMEOUT", "30"))
        )
        self.max_hold_s = max_hold_s
        self.models = ModelMap(self.config)
        self._adm: Admission | None = None
        self._pid = 0
        self._attaching: asyncio.Lock | None = None
        self._tickets: dict[str, tuple[float, Ticket]] = {}  # litellm_call_id -> ticket

    async def _admission(self) -> Admission:
        if self._adm is not None and self._pid == os.getpid():
            return self._adm
        if self._attaching is None:
            self._attaching = asyncio.Lock()
        async with self._attaching:
            if self._adm is None or self._pid != os.getpid():  # a forked worker attaches anew
                self._adm = await asyncio.to_thread(
                    Admission.attach, config=self.config, generation=self.generation
                )
                self._pid = os.getpid()
        return self._adm

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: Any
    ) -> dict[str, Any]:
        model = data.get("model")
        provider = self.models.provider(model) if isinstance(model, str) else None
        call_id = data.get("litellm_call_id")
        if provider is None or not isinstance(call_id, str):
            return data
        adm = await self._admission()
        self._give_back_stale(adm)
        try:
            ticket = await adm.acquire(
                provider,
                timeout=self.timeout,
                cls=admission_class(user_api_key_dict),
                tokens=request_tokens(adm, provider, data),
            )
        except RequestTooLarge as exc:  # no worker could hold it: retrying will not help
            raise _too_large(str(exc)) from None
        except QueueFull as exc:
            raise _refusal(429, str(exc), adm.retry_after(provider)) from None
        except AdmissionTimeout:
            message = f"provider {provider}: no slot became free within {self.timeout:g} s"
            raise _refusal(503, message, adm.retry_after(provider)) from None
        except AdmissionError as exc:
            raise _refusal(503, str(exc), 1) from None
        self._tickets[call_id] = (time.monotonic(), ticket)
        return data

    def _release(self, call_id: object) -> None:
        held = self._tickets.pop(call_id, None) if isinstance(call_id, str) else None
        if held is not None and self._adm is not None:
            self._adm.release(held[1])

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._release(kwargs.get("litellm_call_id"))

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self._release(kwargs.get("litellm_call_id"))

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        self._release(request_data.get("litellm_call_id"))

    def _give_back_stale(self, adm: Admission) -> None:
        cutoff = time.monotonic() - self.max_hold_s
        stale = [cid for cid, (since, _) in self._tickets.items() if since < cutoff]
        for cid in stale:
            _, ticket = self._tickets.pop(cid)
            adm.release(ticket)
        if stale:
            log.warning(
                "gave back %d slot(s) held over %g s with no success or failure logged",
                len(stale),
                self.max_hold_s,
            )


CLASS_METADATA_KEY = "admission_class"


def admission_class(user_api_key_dict: Any) -> str | None:
    """The admission class a request's key names: ``admission_class`` in the key's
    metadata, else in its team's (LiteLLM's ``UserAPIKeyAuth.metadata`` and
    ``.team_metadata``, set with ``/key/generate`` and ``/team/new``); None: the
    provider's default class."""
    for metadata in (
        getattr(user_api_key_dict, "metadata", None),
        getattr(user_api_key_dict, "team_metadata", None),
    ):
        if isinstance(metadata, dict) and isinstance(metadata.get(CLASS_METADATA_KEY), str):
            return str(metadata[CLASS_METADATA_KEY])
    return None


def request_tokens(adm: Admission, provider: str, data: dict[str, Any]) -> int:
    """What the request is charged in tokens, as the middleware charges it
    (``AdmissionMiddleware``: the one estimate of ``request_charge``; without
    ``max_tokens``, the most one request of the provider may hold, when published)."""
    charge = request_charge(data)
    limit = adm.request_token_limit(provider) if charge.generated is None else None
    return charge.tokens(limit)


def _too_large(message: str) -> Exception:
    from litellm.proxy._types import ProxyException

    return ProxyException(
        message=f"context_length_exceeded: {message}",
        type="invalid_request_error",
        param=None,
        code=400,
        openai_code="context_length_exceeded",
    )


def _refusal(status: int, message: str, retry_after: int) -> HTTPException:
    return HTTPException(
        status_code=status, detail=message, headers={"Retry-After": str(retry_after)}
    )


proxy_handler_instance = GatewayCapacityAdmission()
