"""Model selection for :class:`handler_shim.asgi.AdmissionMiddleware`: ``provider=by_model``.

:class:`ByModel` reads a request's model where the wrapped application reads it (its route
table, :mod:`handler_shim.model_routes`; the form or JSON body), :class:`ModelMap` maps
that model to the provider whose ``models`` map names it (R-C2), and :class:`Refusal` is
how a request that cannot be admitted on any budget (413, 400) is answered.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import Any, Final

from capacity_contract.tokens import request_charge
from handler_shim.model_routes import (
    FORM_TYPES,
    LITELLM,
    ModelRoute,
    RouteTable,
    form_model,
    match,
    resolve,
    route_path,
)

log = logging.getLogger("gateway_capacity.asgi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]

# The scope key under which ByModel leaves what a JSON body asks for in tokens: a Charge.
CHARGE_KEY: Final = "gateway_capacity.charge"


class ByModel:
    """``provider=`` selector: the provider whose ``models`` map names the request's model.

    The gateway config's ``models`` maps gateway **aliases** to upstream model ids
    (SPEC R-C2), and a gateway's clients name the alias: that is what the request's
    model is matched on. An upstream id is matched too when it names one provider's
    model and is nobody's alias (a client that already speaks the upstream's names, as
    ``examples/openai_gateway.py`` accepts). An alias in two providers' maps goes to the
    first in the file, with one warning. The map follows edits of the config file (checked
    at most once a second; a broken edit keeps the last good map, R-C3).

    **Where the model is read.** ``routes`` is the wrapped application's table of
    inference routes (:mod:`handler_shim.model_routes`; LiteLLM's proxy by default), so
    the model is read where that application reads it:

    * a route whose path carries the model (``/openai/deployments/{model}/chat/completions``,
      ``/engines/{model}/completions``...), or whose query string may
      (``/v1/chat/completions?model=...``): that model, which wins over the body's (the
      body is then not read);
    * else the body's ``model``: a form body (``multipart/form-data``,
      ``application/x-www-form-urlencoded``) by its fields, parsed by Starlette's own form
      parser (the one LiteLLM's ``request.form()`` uses, imported only then), any other
      body as JSON;
    * a model that cannot be read (no model, not a string, empty): **400**
      ``model_required``, never passed on unadmitted, unless ``default=`` names the
      provider to admit such requests on.

    A ``POST``, ``PUT`` or ``PATCH`` on any other route that is not a form: its JSON
    body's ``model`` if it has one, else passed through unadmitted. Whatever the
    ``Content-Type`` says, a body that is not a form is parsed as JSON, since apps such as
    LiteLLM's proxy parse it so (a ``text/plain`` label must not be a way around the
    budget). Bodies are read up to ``max_body`` bytes (1 MiB; an audio upload may want
    more). Then:

    * over ``max_body`` (by ``Content-Length`` or as read): **413** ``request_too_large``;
    * not JSON, or not a JSON object: **400** ``invalid_json`` (a body that cannot be
      read cannot be admitted, and one the app might still parse must not slip past);
      a form the parser refuses: **400** ``invalid_form``;
    * a model no provider names: passed through **unadmitted** (the app answers it; it
      reaches no provider of the config);
    * else admitted on that provider.

    The body reaches the app unchanged: the very messages read are replayed, then the
    server's ``receive`` takes over. A client that goes away while its body is read
    leaves nothing behind (nothing was asked for yet).
    """

    READ_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})
    FORMS: Final = ("multipart/form-data", "application/x-www-form-urlencoded")

    def __init__(
        self,
        *,
        max_body: int = 1 << 20,
        config: str | os.PathLike[str] | None = None,
        routes: RouteTable = LITELLM,
        default: str | None = None,
    ):
        if max_body < 1:
            raise ValueError("max_body must be at least 1 byte")
        if default is not None and not default:
            raise ValueError("default must name a provider (or be None: refuse)")
        self.max_body = max_body
        self.config = config
        self.routes = tuple(routes)
        self.default = default

    def __repr__(self) -> str:
        return f"ByModel(max_body={self.max_body}, default={self.default!r})"

    def wants_body(self, scope: Scope) -> bool:
        if scope.get("method") not in self.READ_METHODS:
            return False
        content_type = _content_type(scope)
        return content_type is None or not content_type.lower().lstrip().startswith(self.FORMS)

    def inference_route(self, scope: Scope) -> tuple[ModelRoute, str] | None:
        """The table's route of this request and the model its path or query string
        carries (or "")."""
        path = route_path(scope.get("path", ""), scope.get("root_path", ""))
        return match(self.routes, scope.get("method", ""), path, scope.get("query_string", b""))

    async def choose(
        self, models: ModelMap, scope: Scope, receive: Receive
    ) -> tuple[str | None, Receive] | None:
        """The provider of the request's model and a ``receive`` that replays what was
        read; None when the client went away meanwhile; raises ``Refusal`` (413, 400)."""
        selector = self
        inference = selector.inference_route(scope)
        if inference is not None:
            chosen, endpoint_model = inference
            if endpoint_model:  # the path's or query's model wins: the body only charges
                provider = models.provider(endpoint_model)
                if provider is None or not selector.wants_body(scope):
                    return provider, receive
                charged = await _charge_only(scope, receive, selector.max_body)
                return None if charged is None else (provider, charged)
        elif not selector.wants_body(scope):
            return None, receive
        messages = await _read_body(scope, receive, selector.max_body)
        if messages is None:
            return None
        body = b"".join(m.get("body", b"") for m in messages)
        replay = _replay(messages, receive)
        if inference is None:
            model = _json_model(body, scope)
            provider = models.provider(model) if isinstance(model, str) else None
            return provider, replay
        content_type = _content_type(scope) or ""
        if content_type.split(";", 1)[0].strip().lower() in FORM_TYPES:
            body_model = await _form_model(scope, body, field_by_field=chosen.form_items)
        else:
            body_model = _json_model(body, scope)
        model = resolve("", body_model)
        if model is not None:
            return models.provider(model), replay
        if selector.default is not None:
            return selector.default, replay
        raise Refusal(
            400,
            "model_required",
            f"{chosen.template.replace('{model:path}', '{model}')}: the request names no "
            "model (a string in the body's model field) to be admitted on",
        )


by_model: Final = ByModel()
"""The default :class:`ByModel` (1 MiB bodies, the middleware's own ``config``, LiteLLM's
routes, no default provider: a model that cannot be read is refused)."""


class Refusal(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


async def _read_body(scope: Scope, receive: Receive, cap: int) -> list[Message] | None:
    """The request's messages up to the end of its body; None when the client went away.
    Raises ``Refusal`` 413 as soon as the body is known to exceed ``cap`` bytes."""
    too_large = Refusal(413, "request_too_large", f"the request body is over {cap} bytes")
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                if int(value) > cap:
                    raise too_large
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        messages.append(message)
        size += len(message.get("body", b""))
        if size > cap:
            raise too_large
        if not message.get("more_body", False):
            return messages


async def _charge_only(scope: Scope, receive: Receive, cap: int) -> Receive | None:
    """For a route whose path names the model: read the body up to ``cap`` bytes for its
    tokens alone (``scope[CHARGE_KEY]`` when it is a JSON object), never refusing it (a
    body over ``cap``, or not JSON, reaches the app as before, charged nothing); a
    ``receive`` that replays what was read; None when the client went away."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        messages.append(message)
        size += len(message.get("body", b""))
        if size > cap:
            return _replay(messages, receive)  # too large to charge: slots alone
        if not message.get("more_body", False):
            break
    body = b"".join(m.get("body", b"") for m in messages)
    with contextlib.suppress(Refusal):
        _json_model(body, scope)
    return _replay(messages, receive)


def _content_type(scope: Scope) -> str | None:
    """The first ``Content-Type`` header (as Starlette's ``headers[...]`` reads it)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return bytes(value).decode("latin-1")
    return None


def _json_model(body: bytes, scope: Scope | None = None) -> object:
    """The JSON body's ``model`` (None when there is none); ``Refusal`` 400 when the body
    is not a JSON object. What it asks for in tokens goes into ``scope[CHARGE_KEY]``."""
    if not body:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError included; nested too deep
        raise Refusal(400, "invalid_json", "the request body is not JSON") from None
    if not isinstance(doc, dict):
        raise Refusal(400, "invalid_json", "the request body must be a JSON object")
    if scope is not None:
        scope[CHARGE_KEY] = request_charge(doc)
    return doc.get("model")


async def _form_model(scope: Scope, body: bytes, *, field_by_field: bool) -> object:
    """The form's ``model`` as the wrapped Starlette app reads it: Starlette's own parser,
    with ``Request.form()``'s limits; ``Refusal`` 400 when it refuses the form."""
    try:
        from starlette.datastructures import Headers
        from starlette.formparsers import FormParser, MultiPartParser
    except ImportError:  # a Starlette app has it; nothing else reads forms this way
        raise Refusal(
            400, "invalid_form", "form bodies cannot be read here (starlette is not installed)"
        ) from None

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body
        yield b""

    headers = Headers(raw=list(scope.get("headers", ())))
    parser: FormParser | MultiPartParser
    if headers.get("content-type", "").split(";", 1)[0].strip().lower() == "multipart/form-data":
        parser = MultiPartParser(
            headers, stream(), max_files=1000, max_fields=1000, max_part_size=1024 * 1024
        )
    else:
        parser = FormParser(headers, stream())
    try:
        form = await parser.parse()
    except Exception as exc:  # what Request.form() raises is the app's 400 too
        raise Refusal(400, "invalid_form", f"the form body cannot be parsed: {exc}") from None
    try:
        return form_model(form.multi_items(), field_by_field=field_by_field)
    finally:
        await form.close()


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then the server's."""
    pending = deque(messages)

    async def replay() -> Message:
        if pending:
            return pending.popleft()
        return await receive()

    return replay


class ModelMap:
    """Model name -> provider id, from the gateway config's ``models`` maps (R-C2): what
    :class:`ByModel` matches on (read its docstring), for hooks that pick a provider by
    model too (``examples/litellm_admission.py``). ``provider(model)`` or None.

    Re-read when the file changes (looked at, at most once a second: one ``stat``); a file
    that cannot be read or parsed keeps the last good map and is logged once (R-C3, R-C4).
    """

    RECHECK_S: Final = 1.0

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._stamp: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self._map: dict[str, str] = {}
        self._complaint = ""

    def provider(self, model: str) -> str | None:
        now = time.monotonic()
        if now - self._checked >= self.RECHECK_S:
            self._checked = now
            self._refresh()
        return self._map.get(model)

    def _refresh(self) -> None:
        from gateway_config import read_config_file
        from shm_layout.errors import ConfigError

        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return
            config = read_config_file(self.path)
        except (OSError, ConfigError) as exc:
            self._complain(f"by_model: {exc}; keeping the last good model map")
            return
        self._stamp = stamp
        self._complaint = ""
        aliases: dict[str, str] = {}
        upstream: dict[str, set[str]] = {}
        for p in config.providers:
            for alias, upstream_id in p.models.items():
                if alias in aliases and aliases[alias] != p.id:
                    self._complain(
                        f"by_model: model {alias!r} is in the models of providers "
                        f"{aliases[alias]!r} and {p.id!r}; admitting it on {aliases[alias]!r}"
                    )
                aliases.setdefault(alias, p.id)
                upstream.setdefault(upstream_id, set()).add(p.id)
        by_upstream = {
            model: next(iter(ids))
            for model, ids in upstream.items()
            if len(ids) == 1 and model not in aliases
        }
        self._map = {**by_upstream, **aliases}

    def _complain(self, text: str) -> None:
        if text != self._complaint:
            self._complaint = text
            log.warning("%s", text)
