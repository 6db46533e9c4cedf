"""How each kind of inference server says how many requests it runs at once.

One reader per registry ``source``; each follows what that server's own code
exposes (docs/router.md has the table: endpoint, field, version, what the
user sees). Every reader gets a :class:`Fetch` (the worker's URL, the
client, the worker's bearer key if any) and the registered model ids, and
returns a :class:`Reading`; it raises :class:`Unhealthy` when the server says
it cannot serve and :class:`Unreadable` when it answers but its count cannot
be read. Network errors are the poller's to classify.

Served ids: where the server lists what it serves (``GET /v1/models``, or its
own list), a registered id it does not list counts 0 and is reported in
``Reading.unserved``. A server without such a list (404) is not checked.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from shm_layout.errors import GatewayCapacityError
from sidecar.contract import MAX_SLOTS, read_capped

from .registry import SlotSource, endpoint

JSON_BODY_LIMIT = 1 << 20  # llama.cpp's /props carries the chat template
METRICS_BODY_LIMIT = 4 << 20
_BIG = 1 << 31

_T = TypeVar("_T")


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


@dataclass(slots=True)
class Fetch:
    """GETs against one worker URL, with its bearer key; ``stage`` names the last path."""

    client: httpx.AsyncClient
    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    stage: str = "/health"

    async def status(self, path: str) -> int:
        self.stage = "/" + path
        async with self.client.stream("GET", endpoint(self.url, path), headers=self.headers) as r:
            return r.status_code

    async def get(self, path: str, limit: int = JSON_BODY_LIMIT) -> tuple[int, bytes]:
        self.stage = "/" + path.split("?", 1)[0]
        async with self.client.stream("GET", endpoint(self.url, path), headers=self.headers) as r:
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


class _Props(msgspec.Struct):  # llama.cpp tools/server/server-context.cpp get_res_props
    total_slots: Annotated[int, msgspec.Meta(ge=0, le=MAX_SLOTS)]


class _Status(msgspec.Struct):  # llama.cpp server-models.cpp get_router_models
    value: str


class _Model(msgspec.Struct):  # OpenAI list entry; aliases/status are llama.cpp's
    id: str
    aliases: list[str] = []
    status: _Status | None = None


class _ModelList(msgspec.Struct):
    data: list[_Model]


class _SglangState(msgspec.Struct):  # sglang scheduler get_internal_state
    effective_max_running_requests_per_dp: Count


class _SglangInfo(msgspec.Struct):  # sglang http_server.py get_server_info
    internal_states: Annotated[list[_SglangState], msgspec.Meta(min_length=1)]
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1


class _TgiInfo(msgspec.Struct):  # TGI router/src/lib.rs struct Info
    max_concurrent_requests: Count


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


class _SwapProcess(msgspec.Struct):  # llama-swap proxymanager.go listRunningProcessesHandler
    model: str
    state: str


class _SwapRunning(msgspec.Struct):
    running: list[_SwapProcess]


_props = msgspec.json.Decoder(_Props, strict=True)
_models = msgspec.json.Decoder(_ModelList, strict=True)
_sglang = msgspec.json.Decoder(_SglangInfo, strict=True)
_tgi = msgspec.json.Decoder(_TgiInfo, strict=True)
_lms = msgspec.json.Decoder(_LmsModels, strict=True)
_swap = msgspec.json.Decoder(_SwapRunning, strict=True)


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
    status, body = await fetch.get("v1/models")
    if status in (404, 405, 501):
        return None
    if status != 200:
        raise Unreadable(f"/v1/models answered {status}{_hint(status)}")
    try:
        return _ids(_models.decode(body))
    except msgspec.DecodeError as exc:
        raise Unreadable(f"/v1/models: {exc}") from None


def _per_model(models: tuple[str, ...], served: frozenset[str] | None, count: int) -> Reading:
    if served is None:
        return Reading(count)
    unserved = tuple(m for m in dict.fromkeys(models) if m not in served)
    return Reading(count, {m: count for m in models if m in served}, unserved=unserved)


# -- readers --------------------------------------------------------------------

Reader = Callable[[Fetch, tuple[str, ...], SlotSource], Awaitable[Reading]]


async def read_props(fetch: Fetch, models: tuple[str, ...], slots: SlotSource) -> Reading:
    """llama-server: ``GET /props`` ``total_slots`` (its ``--parallel``)."""
    served = await served_ids(fetch)
    props = await fetch.json("props", _props)
    return _per_model(models, served, props.total_slots)


async def read_llama_router(fetch: Fetch, models: tuple[str, ...], slots: SlotSource) -> Reading:
    """llama-server ``--models-dir``: ``GET /models`` status per model, then
    ``GET /props?model=ID&autoload=false`` for a loaded or sleeping one (never loads it)."""
    listed = await fetch.json("models", _models)
    by_name: dict[str, _Model] = {}
    for entry in listed.data:
        for name in (entry.id, *entry.aliases):
            by_name.setdefault(name, entry)
    per_model: dict[str, int] = {}
    unknown: set[str] = set()
    unserved: list[str] = []
    states: list[str] = []
    for model in dict.fromkeys(models):
        found = by_name.get(model)
        if found is None:
            unserved.append(model)
            continue
        state = found.status.value if found.status is not None else "unknown"
        states.append(f"{model}: {state}")
        if state in ("loaded", "sleeping"):
            query = f"props?model={quote(found.id, safe='')}&autoload=false"
            try:
                per_model[model] = (await fetch.json(query, _props)).total_slots
            except Unreadable:
                unknown.add(model)
        elif state in ("loading", "downloading"):
            unknown.add(model)
        elif state in ("unloaded", "downloaded"):
            per_model[model] = slots.fixed or 0
        else:  # failed or a state this router does not know: nothing to count on
            per_model[model] = 0
    return Reading(
        sum(per_model.values()),
        per_model,
        frozenset(unknown),
        tuple(unserved),
        activity=", ".join(states),
    )


async def read_sglang(fetch: Fetch, models: tuple[str, ...], slots: SlotSource) -> Reading:
    """SGLang: ``GET /server_info`` (``/get_server_info`` before it was renamed):
    ``internal_states[i].effective_max_running_requests_per_dp`` times ``dp_size``."""
    served = await served_ids(fetch)
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
    per_dp = min(s.effective_max_running_requests_per_dp for s in info.internal_states)
    return _per_model(models, served, _cap(per_dp * info.dp_size))


async def read_tgi(fetch: Fetch, models: tuple[str, ...], slots: SlotSource) -> Reading:
    """Text Generation Inference: ``GET /info`` ``max_concurrent_requests``."""
    served = await served_ids(fetch)
    info = await fetch.json("info", _tgi)
    return _per_model(models, served, _cap(info.max_concurrent_requests))


async def read_lmstudio(fetch: Fetch, models: tuple[str, ...], slots: SlotSource) -> Reading:
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


async def read_fixed_checked(fetch: Fetch, models: tuple[str, ...], slots: SlotSource) -> Reading:
    """vLLM, Ollama, mlx_lm.server, LocalAI: the operator's ``fixed`` count, with
    the served ids checked (and vLLM's running/waiting gauges for ``router show``)."""
    assert slots.fixed is not None
    served = await served_ids(fetch)
    reading = _per_model(models, served, slots.fixed)
    if slots.kind != "vllm":
        return reading
    return Reading(
        reading.slots,
        reading.per_model,
        reading.unknown,
        reading.unserved,
        activity=await _vllm_activity(fetch),
    )


async def _vllm_activity(fetch: Fetch) -> str:
    try:
        status, body = await fetch.get("metrics", METRICS_BODY_LIMIT)
    except Unreadable:
        return ""
    if status != 200:
        return ""
    running = gauge_sum(body, "vllm:num_requests_running")
    waiting = gauge_sum(body, "vllm:num_requests_waiting")
    if running is None or waiting is None:
        return ""
    return f"{running:g} running, {waiting:g} waiting"


def gauge_sum(text: bytes, name: str) -> float | None:
    """The sum of a Prometheus gauge over its label sets, or None if absent."""
    total: float | None = None
    prefix = name.encode()
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        rest = line[len(prefix) :]
        if rest[:1] not in (b"{", b" "):
            continue  # another metric sharing the prefix
        try:
            value = float(rest.rsplit(b"}", 1)[-1].split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            total = (total or 0.0) + value
    return total


async def read_llama_swap(fetch: Fetch, models: tuple[str, ...], slots: SlotSource) -> Reading:
    """llama-swap: ``GET /running``; for a model whose process is ``ready``,
    ``GET /upstream/MODEL/props`` (already running: no load is triggered); a
    model not running counts ``fixed`` (its ``concurrencyLimit``) or 0."""
    served = await served_ids(fetch)
    running = await fetch.json("running", _swap)
    ready = {p.model for p in running.running if p.state == "ready"}
    per_model: dict[str, int] = {}
    unknown: set[str] = set()
    unserved: list[str] = []
    for model in dict.fromkeys(models):
        if served is not None and model not in served:
            unserved.append(model)
            continue
        if model in ready:
            try:
                props = await fetch.json(f"upstream/{quote(model, safe='')}/props", _props)
                per_model[model] = props.total_slots
            except Unreadable:
                unknown.add(model)
        else:
            per_model[model] = slots.fixed or 0
    activity = "running: " + (", ".join(sorted(ready)) or "none")
    return Reading(
        sum(per_model.values()), per_model, frozenset(unknown), tuple(unserved), activity
    )


READERS: dict[str, Reader] = {
    "props": read_props,
    "llama-server-router": read_llama_router,
    "sglang": read_sglang,
    "tgi": read_tgi,
    "lmstudio": read_lmstudio,
    "vllm": read_fixed_checked,
    "ollama": read_fixed_checked,
    "mlx": read_fixed_checked,
    "localai": read_fixed_checked,
    "llama-swap": read_llama_swap,
}

HEALTH_PATHS: dict[str, str] = {
    "fixed": "health",
    "props": "health",
    "llama-server-router": "health",
    "sglang": "health",  # 503 while starting or after a failed health check
    "tgi": "health",
    "lmstudio": "api/v1/models",  # no health endpoint: the model list answers when up
    "vllm": "health",  # 503 when the engine is dead
    "ollama": "",  # GET / answers "Ollama is running"
    "mlx": "v1/models",  # mlx_lm.server: the model list is what it surely serves
    "localai": "readyz",
    "llama-swap": "health",
}
