"""Where a wrapped application reads a request's ``model``: one table per known application.

:class:`handler_shim.asgi.ByModel` must admit a request on the budget of the model the
wrapped application will serve, so it reads the model where that application reads it.
A table lists the application's **inference routes** in its own order of matching (the
first route whose pattern matches the path wins, as in Starlette's router), each with:

* the path parameter that carries the model, if any (the Azure- and engine-style routes:
  ``/openai/deployments/{model}/chat/completions``), or the query parameter (FastAPI takes
  an endpoint's ``model`` argument that is not in its path from the query string:
  ``/v1/chat/completions?model=...``); either wins over the body's ``model`` when it is
  not empty;
* how a form body is read (``multipart/form-data``, ``application/x-www-form-urlencoded``):
  ``dict(form)`` (the last ``model`` field) or the field-by-field walk of LiteLLM's
  ``get_form_data`` (where ``model[]`` makes a list of the model, not a string).

Any other body is parsed as JSON. A request to a table's route whose model cannot be read
(no model, not a string, empty) is not the application's to serve unadmitted: the
middleware refuses it unless the operator named a default provider.

:data:`LITELLM` mirrors ``litellm.proxy.proxy_server:app`` (litellm 1.108.7:
``proxy_server.py``, ``image_endpoints``, ``response_api_endpoints``, ``rerank_endpoints``,
``google_endpoints``; ``common_utils/http_parsing_utils.py``: ``read_request_body``,
``get_form_data``, ``resolve_inference_model``). ``tests/litellm/test_litellm_routes.py``
checks it against the installed package's own router.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple
from urllib.parse import parse_qsl

FORM_TYPES: Final = frozenset({"application/x-www-form-urlencoded", "multipart/form-data"})

_PARAM = re.compile(r"\{([a-zA-Z_][a-zA-Z0-9_]*)(?::(path|str))?\}")


def compile_template(template: str) -> re.Pattern[str]:
    """A route template as Starlette compiles it: ``{name}`` is one path segment,
    ``{name:path}`` any text (slashes included, empty too), the rest is literal."""
    pattern, end = "^", 0
    for m in _PARAM.finditer(template):
        pattern += re.escape(template[end : m.start()])
        pattern += f"(?P<{m[1]}>.*)" if m[2] == "path" else f"(?P<{m[1]}>[^/]+)"
        end = m.end()
    return re.compile(pattern + re.escape(template[end:]) + "$")


class ModelRoute(NamedTuple):
    """One inference route: ``template`` (Starlette's syntax), the name of its path
    parameter that carries the model (or None), the name of the query parameter that
    does (or None), and whether a form body is read field by field (``get_form_data``)
    instead of as ``dict(form)``."""

    template: str
    path_model: str | None
    pattern: re.Pattern[str]
    query_model: str | None = None
    form_items: bool = False


def route(
    template: str,
    path_model: str | None = None,
    *,
    query_model: str | None = None,
    form_items: bool = False,
) -> ModelRoute:
    return ModelRoute(template, path_model, compile_template(template), query_model, form_items)


RouteTable = Sequence[ModelRoute]


def match(
    table: RouteTable, method: str, path: str, query_string: bytes = b""
) -> tuple[ModelRoute, str] | None:
    """The first route of ``table`` that a ``POST`` to ``path`` matches, with the model its
    path or query string carries (``""`` when none); None for any other request."""
    if method != "POST":
        return None
    for r in table:
        m = r.pattern.match(path)
        if m is None:
            continue
        if r.path_model is not None:
            return r, m[r.path_model]
        if r.query_model is not None:
            return r, query_value(query_string, r.query_model)
        return r, ""
    return None


def query_value(query_string: bytes, name: str) -> str:
    """The last value of ``name`` in the query string, as Starlette's ``QueryParams`` and
    FastAPI's scalar query parameters read it (``""`` when absent)."""
    pairs = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
    return next((value for key, value in reversed(pairs) if key == name), "")


def route_path(path: str, root_path: str) -> str:
    """The path a Starlette router matches: ``path`` without the app's ``root_path``
    (``starlette._utils.get_route_path``)."""
    if not root_path or not path.startswith(root_path):
        return path
    if path == root_path:
        return ""
    if path[len(root_path)] == "/":
        return path[len(root_path) :]
    return path


def form_model(items: Iterable[tuple[str, object]], *, field_by_field: bool) -> object:
    """The ``model`` the application reads from a form's fields (in order): the last
    ``model`` field (``dict(form)``); read field by field, a later ``model[]`` makes the
    model a list (or fails), so only a plain ``model`` field last gives a string."""
    model: object = None
    for key, value in items:
        if key == "model":
            model = value
        elif field_by_field and key == "model[]":
            model = None  # a list of models (or LiteLLM's error): not one to admit
    return model


def resolve(endpoint_model: str, body_model: object) -> str | None:
    """The model the application serves: the path's or query's when not empty, else the
    body's (``resolve_inference_model``: ``endpoint_model or body_model``); None when that
    is not a string naming something."""
    model = endpoint_model or body_model
    return model if isinstance(model, str) and model else None


def _both(
    *templates: str,
    path_model: str | None = None,
    query_model: str | None = None,
    form_items: bool = False,
) -> list[ModelRoute]:
    return [route(t, path_model, query_model=query_model, form_items=form_items) for t in templates]


# litellm.proxy.proxy_server:app, POST routes that call a model, in the app's order.
LITELLM: Final[tuple[ModelRoute, ...]] = (
    *_both(
        "/openai/deployments/{model:path}/chat/completions",
        "/engines/{model:path}/chat/completions",
        path_model="model",
    ),
    *_both("/chat/completions", "/v1/chat/completions", query_model="model"),
    *_both(
        "/openai/deployments/{model:path}/completions",
        "/engines/{model:path}/completions",
        path_model="model",
    ),
    *_both("/completions", "/v1/completions", query_model="model"),
    *_both(
        "/openai/deployments/{model:path}/embeddings",
        "/engines/{model:path}/embeddings",
        path_model="model",
    ),
    *_both("/embeddings", "/v1/embeddings", query_model="model"),
    *_both("/moderations", "/v1/moderations"),
    *_both("/audio/speech", "/v1/audio/speech"),
    *_both("/audio/transcriptions", "/v1/audio/transcriptions", form_items=True),
    *_both("/openai/v1/responses", "/responses", "/v1/responses"),
    *_both("/rerank", "/v1/rerank", "/v2/rerank"),
    route("/openai/deployments/{model:path}/images/generations", "model"),
    *_both("/images/generations", "/v1/images/generations", query_model="model"),
    route("/openai/deployments/{model:path}/images/edits", "model"),
    *_both("/images/edits", "/v1/images/edits", query_model="model"),
    *_both(
        "/models/{model_name:path}:generateContent",
        "/v1beta/models/{model_name:path}:generateContent",
        "/models/{model_name:path}:streamGenerateContent",
        "/v1beta/models/{model_name:path}:streamGenerateContent",
        path_model="model_name",
    ),
    route("/queue/chat/completions", query_model="model"),
)
"""LiteLLM's proxy (the routes ``by_model`` knows by default; docs/litellm.md lists them)."""
