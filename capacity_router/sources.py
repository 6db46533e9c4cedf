"""How each kind of inference server says how many requests it runs at once.

One reader per registry ``source``; each follows what that server's own code
exposes (docs/router.md has the table: endpoint, field, version, what the
user sees). Every reader gets a :class:`Fetch` (the worker's URL, the
client, the worker's bearer key if any) and the registered model ids, and
returns a :class:`Reading`; it raises :class:`Unhealthy` when the server says
it cannot serve and :class:`Unreadable` when it answers but its count cannot
be read. Network errors are the poller's to classify.

Token capacity (R-K7): a reader that can read it sets ``Reading.request_tokens`` (the
most one request may hold, prompt plus generated) and ``Reading.running_tokens`` (what
all running requests may hold together), each from the server's own field
(docs/router.md has the table); None where the server does not say, and a failed or
absent read of them never makes a worker unreadable: its slots still count.

Served ids: where the server lists what it serves (``GET /v1/models``, or its
own list), a registered id it does not list counts 0 and is reported in
``Reading.unserved``. A server without such a list (404) is not checked.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from capacity_contract import MAX_SLOTS, read_capped
from shm_layout.errors import GatewayCapacityError

OPTIONAL_READ_S = 0.5
"""The most a read for ``router show`` alone may take, within the poll's deadline."""
JSON_BODY_LIMIT = 1 << 20  # llama.cpp's /props carries the chat template
METRICS_BODY_LIMIT = 4 << 20
_BIG = 1 << 31

_T = TypeVar("_T")


def endpoint(url: str, name: str) -> str:
    """``{url}/{name}`` with exactly one slash (a URL may carry a path prefix)."""
    return f"{url.rstrip('/')}/{name}"


class Unhealthy(Exception):
    """The server answered that it cannot serve now (e.g. 503 while loading)."""


class Unreadable(GatewayCapacityError):
    """The server answers, but its slot count cannot be read. ``str()``: the reason."""


@dataclass(frozen=True, slots=True)
class Reading:
    """What a reader found. ``per_model`` None: ``slots`` counts for every id."""

    slots: int
    per_model: Mapping[str, int] | None = None
    unknown: frozenset[str] = frozenset()
    unserved: tuple[str, ...] = ()
    activity: str = ""
    unlisted: tuple[str, ...] = ()
    running: float | None = None  # requests the server says it runs now, where it says
    waiting: float | None = None  # requests it says it holds in its own queue
    request_tokens: int | None = None  # the most one request may hold (R-K7)
    running_tokens: int | None = None  # what all running requests may hold together
    tokens_from: str = ""  # where the token figures come from, for ``router show``
    preemptions: float | None = None  # the server's cumulative preemption count
    kv_usage: float | None = None  # the share of its KV cache in use, 0..1


@dataclass(slots=True)
class Fetch:
    """GETs against one worker URL, with its bearer key; ``stage`` names the last path."""

    client: httpx.AsyncClient
    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    stage: str = "/health"
    # sni_hostname: the URL names a pinned address, TLS verifies the worker's own name
    extensions: Mapping[str, str] = field(default_factory=dict)

    async def status(self, path: str) -> int:
        self.stage = "/" + path
        async with self.client.stream(
            "GET", endpoint(self.url, path), headers=self.headers, extensions=self.extensions
        ) as r:
            return r.status_code

    async def get(self, path: str, limit: int = JSON_BODY_LIMIT) -> tuple[int, bytes]:
        self.stage = "/" + path.split("?", 1)[0]
        async with self.client.stream(
            "GET", endpoint(self.url, path), headers=self.headers, extensions=self.extensions
        ) as r:
            body = await read_capped(r.aiter_raw(), limit)
            if body is None:
                raise Unreadable(f"{self.stage} body over {limit} bytes")
            return r.status_code, body

    async def json(self, path: str, decoder: msgspec.json.Decoder[_T]) -> _T:
        status, body = await self.get(path)
        if status != 200:
            raise Unreadable(f"{self.stage} answered {status}{_hint(status)}")
        try:
            return decoder.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise Unreadable(f"{self.stage}: {exc}") from None


def _hint(status: int) -> str:
    return " (the worker wants a key: keyFile)" if status in (401, 403) else ""


# -- wire types: only the fields read, each as the server's source names it --

Count = Annotated[int, msgspec.Meta(ge=0, le=_BIG)]


class _SlotSettings(msgspec.Struct):  # llama.cpp server_slot to_json: "context size per slot"
    n_ctx: Count | None = None


class _Props(msgspec.Struct):  # llama.cpp tools/server/server-context.cpp get_res_props
    total_slots: Annotated[int, msgspec.Meta(ge=0, le=MAX_SLOTS)]
    default_generation_settings: _SlotSettings | None = None


class _LlamaMeta(msgspec.Struct):  # llama.cpp model_meta: n_ctx is llama_n_ctx, all slots'
    n_ctx: Count | None = None


class _Status(msgspec.Struct):  # llama.cpp server-models.cpp get_router_models
    value: str
    failed: bool = False  # set with exit_code when the model's process failed to load


class _RouterProps(msgspec.Struct):  # llama.cpp server-models.cpp get_router_props
    models_autoload: bool = True


class _Model(msgspec.Struct):  # OpenAI list entry; aliases/status/meta are llama.cpp's
    id: str
    aliases: list[str] = []
    status: _Status | None = None
    meta: _LlamaMeta | None = None
    max_model_len: Count | None = None  # vLLM entrypoints/openai ModelCard


class _ModelList(msgspec.Struct):
    data: list[_Model]


class _SglangMemory(msgspec.Struct):  # sglang scheduler get_internal_state memory_usage
    token_capacity: Count | None = None  # its max_total_num_tokens


class _SglangState(msgspec.Struct):  # sglang scheduler get_internal_state
    effective_max_running_requests_per_dp: Count | None = None  # from 0.5.8
    memory_usage: _SglangMemory | None = None


class _SglangInfo(msgspec.Struct):  # sglang http_server.py get_server_info
    internal_states: list[_SglangState] = []
    max_running_requests: Count | None = None  # server_args: --max-running-requests or null
    dp_size: Count | None = None  # server_args
    # scheduler get_init_info, merged into the answer: the KV pool of one rank, and
    # min(context_len, max_total_num_tokens) - 1
    max_total_num_tokens: Count | None = None
    max_req_input_len: Count | None = None


class _TgiInfo(msgspec.Struct):  # TGI router/src/lib.rs struct Info
    max_concurrent_requests: Count
    max_total_tokens: Count | None = None  # prompt plus generated, one request
    max_batch_total_tokens: Count | None = None  # all requests of a batch together


class _LmsConfig(msgspec.Struct):  # LM Studio REST v1 GET /api/v1/models
    parallel: Count | None = None


class _LmsInstance(msgspec.Struct):
    id: str
    config: _LmsConfig


class _LmsModel(msgspec.Struct):
    key: str
    loaded_instances: list[_LmsInstance] = []


class _LmsModels(msgspec.Struct):
    models: list[_LmsModel]


class _SwapProcess(msgspec.Struct):  # llama-swap internal/server/api.go handleRunning
    model: str
    state: str
    cmd: str = ""


class _SwapRunning(msgspec.Struct):
    running: list[_SwapProcess]


_props = msgspec.json.Decoder(_Props, strict=True)
_models = msgspec.json.Decoder(_ModelList, strict=True)
_sglang = msgspec.json.Decoder(_SglangInfo, strict=True)
_tgi = msgspec.json.Decoder(_TgiInfo, strict=True)
_lms = msgspec.json.Decoder(_LmsModels, strict=True)
_swap = msgspec.json.Decoder(_SwapRunning, strict=True)
_router_props = msgspec.json.Decoder(_RouterProps, strict=True)


class _Slot(msgspec.Struct):  # llama.cpp server-context.cpp: GET /slots, one entry per slot
    is_processing: bool = False
    n_ctx: Count | None = None  # the slot's context


class _SglangLoad(msgspec.Struct):  # sglang managers/load_snapshot.py LoadSnapshot
    num_running_reqs: Count = 0
    num_waiting_reqs: Count = 0
    max_running_requests: Count | None = None
    max_total_num_tokens: Count | None = None


class _SglangLoads(msgspec.Struct):  # sglang GET /v1/loads (0.5.8+), one entry per DP rank
    loads: list[_SglangLoad]


_slots = msgspec.json.Decoder(list[_Slot], strict=True)
_sglang_loads = msgspec.json.Decoder(_SglangLoads, strict=True)


async def _optional(fetch: Fetch, path: str, limit: int = JSON_BODY_LIMIT) -> bytes | None:
    """The body of ``GET path`` if it answers 200, else None: a read for
    ``router show`` only, which never makes a worker unreadable. ``fetch.stage``
    is left as it was, so a later failure names the read that counts."""
    stage = fetch.stage
    try:
        async with asyncio.timeout(OPTIONAL_READ_S):
            status, body = await fetch.get(path, limit)
    except (Unreadable, httpx.HTTPError, TimeoutError):
        return None
    finally:
        fetch.stage = stage
    return body if status == 200 else None


class _OllamaDetails(msgspec.Struct):  # ollama api/types.go ModelDetails
    family: str = ""


class _OllamaModel(msgspec.Struct):  # ollama api/types.go ListModelResponse
    name: str
    model: str = ""
    details: _OllamaDetails = msgspec.field(default_factory=_OllamaDetails)
    capabilities: list[str] | None = None


class _OllamaTags(msgspec.Struct):
    models: list[_OllamaModel]


_ollama = msgspec.json.Decoder(_OllamaTags, strict=True)


class _OllamaLoaded(msgspec.Struct):  # ollama api/types.go ProcessModelResponse
    name: str
    model: str = ""
    context_length: int | None = None  # absent before Ollama stated it


class _OllamaPs(msgspec.Struct):
    models: list[_OllamaLoaded]


_ollama_ps = msgspec.json.Decoder(_OllamaPs, strict=False)


def _cap(n: int) -> int:
    return min(n, MAX_SLOTS)


# -- served ids ---------------------------------------------------------------


def _ids(listed: _ModelList) -> frozenset[str]:
    ids: set[str] = set()
    for model in listed.data:
        ids.add(model.id)
        ids.update(model.aliases)
    return frozenset(ids)


async def served_ids(fetch: Fetch) -> frozenset[str] | None:
    """What ``GET /v1/models`` lists (ids and llama.cpp aliases); None: no such list."""
    listed = await served_list(fetch)
    return None if listed is None else _ids(listed)


async def served_list(fetch: Fetch) -> _ModelList | None:
    """``GET /v1/models`` as it is; None: no such list."""
    status, body = await fetch.get("v1/models")
    if status in (404, 405, 501):
        return None
    if status == 200 and not body.strip():
        return None  # mlx_lm.server without a model cache: 200, no body; no list either
    if status != 200:
        raise Unreadable(f"/v1/models answered {status}{_hint(status)}")
    try:
        return _models.decode(body)
    except msgspec.DecodeError as exc:
        raise Unreadable(f"/v1/models: {exc}") from None


def _stated(*values: int | None) -> int | None:
    """The smallest stated (non-zero) value, None when none is: 0 is "not set"."""
    stated = [v for v in values if v]
    return min(stated) if stated else None


def _per_model(models: tuple[str, ...], served: frozenset[str] | None, count: int) -> Reading:
    if served is None:
        return Reading(count)
    unserved = tuple(m for m in dict.fromkeys(models) if m not in served)
    return Reading(count, {m: count for m in models if m in served}, unserved=unserved)


# -- readers --------------------------------------------------------------------

Reader = Callable[[Fetch, tuple[str, ...], int | None], Awaitable[Reading]]
"""``(fetch, registered ids, the registry's fixed count) -> Reading``."""


async def read_fixed(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """A bare ``{"fixed": N}``: N for every id, nothing read."""
    assert fixed is not None
    return Reading(fixed)


async def read_props(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """llama-server: ``GET /props`` ``total_slots`` (its ``--parallel``).

    Tokens: a request holds at most its slot's context (``/props``
    ``default_generation_settings.n_ctx``, the smallest of ``/slots[].n_ctx`` where
    that answers: ``llama_n_ctx_seq``, ``-c`` over ``--parallel`` or all of it with a
    unified KV cache); all of them together at most the whole context (``/v1/models``
    ``meta.n_ctx``: ``llama_n_ctx``)."""
    listed = await served_list(fetch)
    served = None if listed is None else _ids(listed)
    props = await fetch.json("props", _props)
    reading = _per_model(models, served, props.total_slots)
    settings = props.default_generation_settings
    per_slot = _stated(settings.n_ctx if settings is not None else None)
    whole = _stated(*(m.meta.n_ctx for m in (listed.data if listed else ()) if m.meta))
    body = await _optional(fetch, "slots")  # on by default; --no-slots answers 501
    slots: list[_Slot] | None = None
    if body is not None:
        try:
            slots = _slots.decode(body)
        except msgspec.DecodeError:
            slots = None
    if slots:
        per_slot = _stated(per_slot, *(slot.n_ctx for slot in slots))
    if per_slot is not None:
        note = f"n_ctx {per_slot} a slot"
        if whole is not None:
            note += f", {whole} in all" + (" (unified KV cache)" if whole == per_slot else "")
        reading = replace(reading, request_tokens=per_slot, running_tokens=whole, tokens_from=note)
    if slots is None:
        return reading
    busy = sum(1 for slot in slots if slot.is_processing)
    return replace(reading, activity=f"{busy} of {props.total_slots} slots busy", running=busy)


async def read_llama_router(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """llama-server ``--models-dir``: ``GET /models`` status per model, then
    ``GET /props?model=ID&autoload=false`` for a loaded or sleeping one (never loads it).

    An unloaded model counts ``fixed`` (or 0) only if a request would load it:
    not after a failed load (``status.failed``), and not when the router runs
    with ``--no-models-autoload`` (its ``/props`` says ``models_autoload``
    false, and a request for an unloaded model gets 400).

    Tokens (tools/server/server-models.cpp: each model runs in its own llama-server
    instance): a loaded model's ``/props`` ``default_generation_settings.n_ctx`` is one
    slot's context and its ``/models`` ``meta.n_ctx`` the instance's whole one, as for a
    single llama-server (:func:`read_props`). The fields are the worker's, for every
    model: stated when every served model is loaded with the same slot context (the
    smallest whole context), else slots only and ``router show`` says why: an unloaded
    model's context is not known until it loads."""
    listed = await fetch.json("models", _models)
    contexts: dict[str, tuple[int | None, int | None]] = {}  # model -> (a slot, in all)
    by_name: dict[str, _Model] = {}
    for entry in listed.data:
        for name in (entry.id, *entry.aliases):
            by_name.setdefault(name, entry)
    per_model: dict[str, int] = {}
    unknown: set[str] = set()
    unserved: list[str] = []
    states: list[str] = []
    autoload: bool | None = None
    for model in dict.fromkeys(models):
        found = by_name.get(model)
        if found is None:
            unserved.append(model)
            continue
        state = found.status.value if found.status is not None else "unknown"
        failed = found.status is not None and found.status.failed
        states.append(f"{model}: {state}{' (failed)' if failed else ''}")
        if state in ("loaded", "sleeping"):
            query = f"props?model={quote(found.id, safe='')}&autoload=false"
            try:
                props = await fetch.json(query, _props)
            except Unreadable:
                unknown.add(model)
            else:
                per_model[model] = props.total_slots
                settings = props.default_generation_settings
                per_slot = _stated(settings.n_ctx if settings is not None else None)
                whole = _stated(found.meta.n_ctx if found.meta else None)
                contexts[model] = (per_slot, whole)
        elif state in ("loading", "downloading"):
            unknown.add(model)
        elif state in ("unloaded", "downloaded") and not failed:
            if autoload is None:
                autoload = (await fetch.json("props", _router_props)).models_autoload
            per_model[model] = (fixed or 0) if autoload else 0
        else:  # failed, or a state this router does not know: nothing to count on
            per_model[model] = 0
    if autoload is False:
        states.append("no autoload")
    reading = Reading(
        sum(per_model.values()),
        per_model,
        frozenset(unknown),
        tuple(unserved),
        activity=", ".join(states),
    )
    return _router_tokens(reading, [m for m in dict.fromkeys(models) if m in by_name], contexts)


def _router_tokens(
    reading: Reading, served: list[str], contexts: dict[str, tuple[int | None, int | None]]
) -> Reading:
    """:func:`read_llama_router`'s token figures (its docstring)."""
    missing = [m for m in served if contexts.get(m, (None, None))[0] is None]
    if not served:
        return reading
    if missing:
        return replace(reading, tokens_from=f"not stated: not loaded: {', '.join(missing)}")
    per_slot = {contexts[m][0] for m in served}
    if len(per_slot) != 1:
        return replace(reading, tokens_from="not stated: models loaded with different contexts")
    request = per_slot.pop()
    whole = _stated(*(contexts[m][1] for m in served))
    note = f"n_ctx {request} a slot" + (f", {whole} in all" if whole is not None else "")
    return replace(reading, request_tokens=request, running_tokens=whole, tokens_from=note)


async def read_sglang(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """SGLang: ``GET /v1/loads`` (0.5.8+): the sum of ``loads[].max_running_requests``
    (one entry per data-parallel rank) and what they run; else ``GET /server_info``
    (``/get_server_info`` before it was renamed):
    the sum of ``internal_states[].effective_max_running_requests_per_dp`` (0.5.8+;
    one entry per data-parallel rank, also with ``--enable-dp-attention``).
    Older releases: ``max_running_requests`` if the server was given it, else
    the operator's ``fixed``."""
    served = await served_ids(fetch)
    loads = await _optional(fetch, "v1/loads")
    if loads is not None:
        try:
            ranks = _sglang_loads.decode(loads).loads
        except msgspec.DecodeError:
            ranks = []
        limits = [r.max_running_requests for r in ranks]
        if ranks and all(n is not None for n in limits):
            running = sum(r.num_running_reqs for r in ranks)
            waiting = sum(r.num_waiting_reqs for r in ranks)
            reading = _per_model(models, served, _cap(sum(n for n in limits if n is not None)))
            pools = [r.max_total_num_tokens for r in ranks]
            if all(pools):
                pool = min(sum(n for n in pools if n is not None), _BIG - 1)
                reading = replace(
                    reading,
                    running_tokens=pool,
                    tokens_from=f"max_total_num_tokens {pool} over {len(ranks)} rank(s)",
                )
            return replace(
                reading,
                activity=f"{running} running, {waiting} waiting",
                running=running,
                waiting=waiting,
            )
    status, body = await fetch.get("server_info")
    if status == 404:
        info = await fetch.json("get_server_info", _sglang)
    elif status != 200:
        raise Unreadable(f"/server_info answered {status}{_hint(status)}")
    else:
        try:
            info = _sglang.decode(body)
        except msgspec.DecodeError as exc:
            raise Unreadable(f"/server_info: {exc}") from None
    per_rank = [s.effective_max_running_requests_per_dp for s in info.internal_states]
    if per_rank and all(n is not None for n in per_rank):
        count = sum(n for n in per_rank if n is not None)
    elif info.max_running_requests is not None:
        count = info.max_running_requests
    elif fixed is not None:
        count = fixed
    else:
        raise Unreadable(
            "/server_info has no effective_max_running_requests_per_dp (SGLang before "
            '0.5.8) nor max_running_requests: state "fixed": N'
        )
    return _sglang_tokens(_per_model(models, served, _cap(count)), info)


def _sglang_tokens(reading: Reading, info: _SglangInfo) -> Reading:
    """SGLang's KV pool: ``internal_states[].memory_usage.token_capacity`` summed over
    its ranks, else ``max_total_num_tokens`` of its one rank; a request at most
    ``max_req_input_len + 1`` (its ``min(context_len, max_total_num_tokens)``)."""
    pools = [
        s.memory_usage.token_capacity if s.memory_usage else None for s in info.internal_states
    ]
    pool: int | None = None
    if pools and all(pools):
        pool = sum(n for n in pools if n is not None)
    elif info.max_total_num_tokens and (info.dp_size or 1) == 1:
        pool = info.max_total_num_tokens
    request = info.max_req_input_len + 1 if info.max_req_input_len else None
    if pool is None and request is None:
        return reading
    pool = None if pool is None else min(pool, _BIG - 1)
    note = f"{pool or 'unknown'} tokens in its KV pool, {request or 'unknown'} a request"
    return replace(reading, running_tokens=pool, request_tokens=request, tokens_from=note)


async def read_tgi(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """Text Generation Inference: ``GET /info`` ``max_concurrent_requests``, its
    admission bound (running plus its own queue); ``fixed``, if stated, is the
    running bound and counts when smaller."""
    served = await served_ids(fetch)
    info = await fetch.json("info", _tgi)
    count = info.max_concurrent_requests
    if fixed is not None:
        count = min(count, fixed)
    reading = _per_model(models, served, _cap(count))
    request, batch_tokens = _stated(info.max_total_tokens), _stated(info.max_batch_total_tokens)
    if request is not None or batch_tokens is not None:
        reading = replace(
            reading,
            request_tokens=request,
            running_tokens=batch_tokens,
            tokens_from=f"max_total_tokens {request or 'unknown'}, "
            f"max_batch_total_tokens {batch_tokens or 'unknown'}",
        )
    body = await _optional(fetch, "metrics", METRICS_BODY_LIMIT)
    if body is None:
        return reading
    batch = gauge_sum(body, "tgi_batch_current_size")
    queue = gauge_sum(body, "tgi_queue_size")
    if batch is None or queue is None:
        return reading
    return replace(
        reading, activity=f"{batch:g} running, {queue:g} queued", running=batch, waiting=queue
    )


async def read_lmstudio(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """LM Studio (REST v1, 0.4.0+): ``GET /api/v1/models``, the sum of
    ``loaded_instances[].config.parallel`` of the model (or of the one instance
    named); a model with no loaded instance counts 0."""
    listed = await fetch.json("api/v1/models", _lms)
    per_model: dict[str, int] = {}
    unknown: set[str] = set()
    unserved: list[str] = []
    for model in dict.fromkeys(models):
        instances: list[_LmsInstance] | None = None
        for entry in listed.models:
            if entry.key == model:
                instances = entry.loaded_instances
                break
            named = [i for i in entry.loaded_instances if i.id == model]
            if named:
                instances = named
                break
        if instances is None:
            unserved.append(model)
            continue
        counts = [i.config.parallel for i in instances]
        if any(c is None for c in counts):
            unknown.add(model)  # an instance without "parallel" (embedding, older build)
            continue
        per_model[model] = _cap(sum(c for c in counts if c is not None))
    return Reading(sum(per_model.values()), per_model, frozenset(unknown), tuple(unserved))


async def read_fixed_checked(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """Ollama, mlx_lm.server, LocalAI: the operator's ``fixed`` count, with the
    served ids checked."""
    assert fixed is not None
    served = await served_ids(fetch)
    return _per_model(models, served, fixed)


# Families Ollama loads with one slot whatever OLLAMA_NUM_PARALLEL says
# (ollama server/sched.go, Scheduler.load).
OLLAMA_ONE_SLOT_FAMILIES = frozenset(
    {
        "mllama",
        "qwen3vl",
        "qwen3vlmoe",
        "qwen35",
        "qwen35moe",
        "qwen3next",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "nemotron_h_omni",
    }
)


async def read_ollama(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """Ollama: ``fixed`` (its ``OLLAMA_NUM_PARALLEL``) per model listed on
    ``GET /api/tags``, but 1 for a model Ollama loads with one slot whatever
    that says: an embedding model (``capabilities`` without ``completion``) and
    the families of :data:`OLLAMA_ONE_SLOT_FAMILIES`."""
    assert fixed is not None
    tags = await fetch.json("api/tags", _ollama)
    by_name: dict[str, _OllamaModel] = {}
    for entry in tags.models:
        by_name.setdefault(entry.name, entry)
        if entry.model:
            by_name.setdefault(entry.model, entry)
    per_model: dict[str, int] = {}
    unserved: list[str] = []
    single: list[str] = []
    for model in dict.fromkeys(models):
        found = by_name.get(model) or by_name.get(f"{model}:latest")
        if found is None:
            unserved.append(model)
            continue
        embedding = found.capabilities is not None and "completion" not in found.capabilities
        if embedding or found.details.family in OLLAMA_ONE_SLOT_FAMILIES:
            per_model[model] = min(fixed, 1)
            single.append(model)
        else:
            per_model[model] = fixed
    activity = f"one slot: {', '.join(single)}" if single else ""
    reading = Reading(
        sum(per_model.values()), per_model, unserved=tuple(unserved), activity=activity
    )
    return await _ollama_tokens(fetch, reading, per_model)


async def _ollama_tokens(fetch: Fetch, reading: Reading, per_model: dict[str, int]) -> Reading:
    """The token figures of an Ollama whose served models are all loaded with one context:
    ``GET /api/ps`` ``models[].context_length`` (server/routes.go PsHandler: the runner's
    ``NumCtx``, the context of one request; llm/llama_server.go starts llama-server with
    ``-c NumCtx x numParallel -np numParallel``, a slot of ``NumCtx`` each), so one
    request holds ``context_length`` and the running requests of a model at most that
    times its slots. A model not loaded yet is loaded with a context nobody stated, and
    the fields are the worker's, for every model: not stated then, nor when the loaded
    models' contexts differ. Each slot holds its own context (no shared pool), so the
    running figure is the context times the most slots a model has."""
    if not per_model:
        return reading
    body = await _optional(fetch, "api/ps")
    if body is None:
        return replace(reading, tokens_from="not stated: GET /api/ps did not answer")
    try:
        loaded = _ollama_ps.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return replace(reading, tokens_from="not stated: GET /api/ps is not Ollama's")
    context: dict[str, int] = {}
    for entry in loaded.models:
        for name in (entry.name, entry.model):
            if name and entry.context_length and entry.context_length > 0:
                context.setdefault(name, entry.context_length)
    found = {m: context.get(m) or context.get(f"{m}:latest") for m in per_model}
    missing = [m for m, n in found.items() if n is None]
    if missing:
        return replace(reading, tokens_from=f"not stated: not loaded: {', '.join(missing)}")
    lengths = {n for n in found.values() if n is not None}
    if len(lengths) != 1:
        return replace(reading, tokens_from="not stated: models loaded with different contexts")
    request = lengths.pop()
    # each slot holds its own context: the running figure never binds before the slots
    slots = max(1, *per_model.values())
    running = min(_BIG - 1, request * slots)
    note = f"context_length {request} a request, {running} over {slots} slot(s)"
    return replace(reading, request_tokens=request, running_tokens=running, tokens_from=note)


async def read_vllm(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """vLLM: ``fixed`` (its ``--max-num-seqs``) per awake engine, with the
    served ids checked. ``GET /metrics`` tells the engines (the ``engine``
    label, one per data-parallel rank), which of them sleep
    (``vllm:engine_sleep_state``) and what they run; without it, one engine."""
    assert fixed is not None
    listed = await served_list(fetch)
    served = None if listed is None else _ids(listed)
    awake, activity = await _vllm_engines(fetch)
    reading = _per_model(models, served, _cap(fixed * awake))
    wanted = set(models)
    request = _stated(*(m.max_model_len for m in (listed.data if listed else ()) if m.id in wanted))
    pool = activity.pool
    if request is not None or pool is not None:
        note = f"max_model_len {request or 'unknown'}, "
        if pool is None or activity.kv is None:
            note += "KV cache unknown"
        else:
            stated = pool
            pool = admissible_tokens(activity.kv, fixed, request)
            note += f"{stated} tokens of KV cache, {pool} admissible in whole blocks"
        reading = replace(reading, request_tokens=request, running_tokens=pool, tokens_from=note)
    return replace(
        reading,
        activity=activity.text,
        running=activity.running,
        waiting=activity.waiting,
        preemptions=activity.preemptions,
        kv_usage=activity.kv_usage,
    )


@dataclass(frozen=True, slots=True)
class _Activity:
    text: str = ""
    running: float | None = None
    waiting: float | None = None
    pool: int | None = None  # tokens of KV cache over the awake engines
    kv: tuple[tuple[int, int], ...] | None = None  # (num_gpu_blocks, block_size) of each
    preemptions: float | None = None
    kv_usage: float | None = None


def vllm_pool(body: bytes, asleep: set[str]) -> int | None:
    """The tokens vLLM's awake engines hold in their KV caches: per engine
    ``vllm:cache_config_info``'s ``num_gpu_blocks`` x ``block_size`` labels (vllm
    v1/metrics/loggers.py, from its CacheConfig), summed; None if any engine's
    cannot be read."""
    kv = vllm_kv(body, asleep)
    return None if kv is None else min(sum(b * s for b, s in kv), _BIG - 1)


def vllm_kv(body: bytes, asleep: set[str]) -> tuple[tuple[int, int], ...] | None:
    """Each awake engine's ``(num_gpu_blocks, block_size)``; None if any engine's
    cannot be read."""
    engines: dict[str, tuple[int, int]] = {}
    for labels, _ in samples(body, "vllm:cache_config_info"):
        try:
            blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            return None  # "None" before the engine profiled its memory
        if blocks <= 1 or size <= 0:
            return None
        engines[labels.get("engine", "")] = (blocks, size)
    awake = tuple(kv for engine, kv in engines.items() if engine not in asleep)
    return awake or None


def admissible_tokens(kv: tuple[tuple[int, int], ...], seqs: int, request: int | None) -> int:
    """The running tokens admission may grant vLLM without preemption (DESIGN.md 6c):
    vLLM v1 keeps one block of each engine's pool aside (``BlockPool.null_block``) and
    gives a request whole blocks (``cdiv(tokens, block_size)``), so ``seqs`` requests
    (its ``--max-num-seqs``, the most that run on an engine) charged ``c_i`` tokens
    hold at most ``sum(c_i) + seqs x (block_size - 1)`` tokens of blocks. Per engine:
    ``(num_gpu_blocks - 1) x block_size - seqs x (block_size - 1)``, but never less than
    one request of ``max_model_len`` in whole blocks (a smaller budget would refuse
    requests vLLM holds alone), nor more than the usable pool; summed."""
    total = 0
    for blocks, size in kv:
        usable = (blocks - 1) * size
        one = -(-request // size) * size if request else size
        total += max(usable - max(0, seqs) * (size - 1), min(usable, one), 0)
    return min(total, _BIG - 1)


async def _vllm_engines(fetch: Fetch) -> tuple[int, _Activity]:
    """(awake engines, what they do) from vLLM's gauges; (1, nothing) if unread."""
    body = await _optional(fetch, "metrics", METRICS_BODY_LIMIT)
    if body is None:
        return 1, _Activity()
    engines = max(1, len(label_values(body, "vllm:num_requests_running", "engine")))
    sleeping = {
        labels.get("engine", "")
        for labels, value in samples(body, "vllm:engine_sleep_state")
        if labels.get("sleep_state") == "awake" and value == 0
    }
    awake = max(0, engines - len(sleeping))
    running = gauge_sum(body, "vllm:num_requests_running")
    waiting = gauge_sum(body, "vllm:num_requests_waiting")
    parts = []
    if running is not None and waiting is not None:
        parts.append(f"{running:g} running, {waiting:g} waiting")
    else:
        running = waiting = None
    if engines > 1:
        parts.append(f"{engines} engines")
    if sleeping:
        parts.append("sleeping" if awake == 0 else f"{len(sleeping)} of {engines} sleeping")
    usage = [value for _, value in samples(body, "vllm:kv_cache_usage_perc")]
    return awake, _Activity(
        ", ".join(parts),
        running,
        waiting,
        pool=vllm_pool(body, sleeping),
        kv=vllm_kv(body, sleeping),
        preemptions=gauge_sum(body, "vllm:num_preemptions_total"),
        kv_usage=max(usage) if usage else None,
    )


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: bytes, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of a Prometheus metric: (labels, value), finite values only."""
    found: list[tuple[dict[str, str], float]] = []
    prefix = name.encode()
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        rest = line[len(prefix) :]
        if rest[:1] not in (b"{", b" "):
            continue  # another metric sharing the prefix
        labels: dict[str, str] = {}
        if rest[:1] == b"{":
            inside, _, rest = rest[1:].rpartition(b"}")
            for pair in _LABEL.finditer(inside.decode("utf-8", "replace")):
                labels[pair.group(1)] = pair.group(2)
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            found.append((labels, value))
    return found


def label_values(text: bytes, name: str, label: str) -> set[str]:
    """The distinct values of one label over a metric's samples."""
    return {labels[label] for labels, _ in samples(text, name) if label in labels}


def gauge_sum(text: bytes, name: str) -> float | None:
    """The sum of a Prometheus gauge over its label sets, or None if absent."""
    found = samples(text, name)
    return sum(value for _, value in found) if found else None


_PARALLEL = re.compile(r"(?:^|\s)(?:--parallel|-np)(?:=|\s+)(\d{1,5})(?=\s|$)")
SWAP_DEFAULT_CONCURRENCY = 10  # llama-swap internal/router/scheduler/fifo.go


def parallel_of(cmd: str) -> int | None:
    """``--parallel N`` / ``-np N`` in a llama-server command line, or None."""
    found = _PARALLEL.findall(cmd)
    return int(found[-1]) if found else None  # the last one given wins


async def read_llama_swap(fetch: Fetch, models: tuple[str, ...], fixed: int | None) -> Reading:
    """llama-swap: ``GET /running`` only, never a path that reaches a model
    (``/upstream/MODEL/...`` passes its admission and refreshes the model's
    ``ttl``). A ``ready`` model counts the ``--parallel``/``-np`` of its ``cmd``,
    at most ``fixed`` (its ``concurrencyLimit``, default 10); a model not
    running, or whose ``cmd`` does not say, counts ``fixed``; with no ``fixed``
    a model not running counts 0 and one whose ``cmd`` does not say is unknown."""
    served = await served_ids(fetch)
    running = await fetch.json("running", _swap)
    ready = {p.model: p for p in running.running if p.state == "ready"}
    per_model: dict[str, int] = {}
    unknown: set[str] = set()
    unserved: list[str] = []
    limit = fixed if fixed is not None else SWAP_DEFAULT_CONCURRENCY
    for model in dict.fromkeys(models):
        if served is not None and model not in served:
            unserved.append(model)
            continue
        process = ready.get(model)
        parallel = parallel_of(process.cmd) if process is not None else None
        if parallel is not None:
            per_model[model] = _cap(min(parallel, limit))
        elif process is None:
            per_model[model] = fixed or 0
        elif fixed is not None:
            per_model[model] = fixed
        else:
            unknown.add(model)  # running, slot count nowhere: the operator states it
    activity = "running: " + (", ".join(sorted(ready)) or "none")
    return Reading(
        sum(per_model.values()), per_model, frozenset(unknown), tuple(unserved), activity
    )


def counted_anyway(reading: Reading) -> Reading:
    """For a server that answers any ``model`` with its one model: the ids it
    does not list count all the same, noted in ``unlisted`` for a warning."""
    if not reading.unserved or reading.per_model is None:
        return reading
    per_model = dict(reading.per_model)
    for model in reading.unserved:
        per_model[model] = reading.slots
    return replace(reading, per_model=per_model, unserved=(), unlisted=reading.unserved)
