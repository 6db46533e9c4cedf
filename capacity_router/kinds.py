"""Every kind of inference server the router reads, one record each.

A :class:`ServerKind` says all the router knows about one kind: the registry
``source`` that names it, how its health is checked, which reader counts its
slots (``capacity_router/sources.py``), whether it routes requests by their
``model`` field, what the operator may or must state as ``fixed``, and the
line ``router simworker`` prints for its simulated shape. The registry's
validation, the poller, the simulated worker, the CLI's choices (and so the
generated shell completions) all read this table, which imports nothing: adding a kind is one record
here, its reader, its fixture under tests/router/fixtures and its row in
docs/router.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

if TYPE_CHECKING:
    from .sources import Reader

FixedRule = Literal["refused", "required", "optional"]
"""``fixed`` in the registry: refused (the count is read), required (nothing
over HTTP tells it), optional (it counts where the server does not tell)."""


@dataclass(frozen=True, slots=True)
class ServerKind:
    """One kind of server, as the router treats it.

    ``source``: the registry name (None for a bare ``{"fixed": N}``);
    ``aliases``: other registry names for it. ``health``: the path GET first
    (``""``: the root); ``health_any_answer``: any answer but a 5xx proves it
    up (else only 200 does); ``health_fallback``: the path to GET when
    ``health`` answers 404 (an older release). ``ignores_model``: the server answers every
    request with its one model whatever the request's ``model`` says, so a
    registered id it does not list still counts (with a warning); otherwise an
    id it does not list counts 0. ``fixed``: see :data:`FixedRule`;
    ``fixed_means``: what the operator states there. ``shape`` and
    ``sim_serves``: the simulated worker's shape name and what it answers
    (None: no simulated shape). ``reader``: the name of its function in
    ``capacity_router/sources.py`` (by name, so that the CLI can list the kinds
    without loading the HTTP client). ``tokens``: where its reader reads the
    token capacity (R-K7) from, ``""``: it does not, and admission of its
    models stays on slots alone.
    """

    name: str
    source: str | None
    reader: str
    health: str
    fixed: FixedRule
    fixed_means: str
    ignores_model: bool = False
    health_any_answer: bool = False
    health_fallback: str = ""
    aliases: tuple[str, ...] = ()
    shape: str | None = None
    sim_serves: str = ""
    tokens: str = ""

    @property
    def read(self) -> Reader:
        """The reader itself."""
        from . import sources

        return cast("Reader", getattr(sources, self.reader))


KINDS: tuple[ServerKind, ...] = (
    ServerKind(
        name="fixed",
        source=None,
        reader="read_fixed",
        health="health",
        health_any_answer=True,  # 501, even 404, prove the process is up
        fixed="required",
        fixed_means="the worker's parallelism, whatever the server",
        ignores_model=True,  # nothing is listed: every registered id counts
    ),
    ServerKind(
        name="props",
        source="props",
        aliases=("llama-server",),
        reader="read_props",
        health="health",
        fixed="refused",
        fixed_means="",
        ignores_model=True,  # one model: llama-server answers any "model"
        shape="llama-server",
        sim_serves="GET /props, GET /health",
        tokens="/props n_ctx a slot, /v1/models meta.n_ctx in all",
    ),
    ServerKind(
        name="llama-server-router",
        source="llama-server-router",
        reader="read_llama_router",
        health="health",
        fixed="optional",
        fixed_means="the slots of a model not loaded now (its --parallel)",
        shape="llama-server-router",
        sim_serves="GET /models, GET /props?model=ID, GET /health",
        tokens="/props?model=ID n_ctx a slot, /models meta.n_ctx, once every model is loaded",
    ),
    ServerKind(
        name="sglang",
        source="sglang",
        reader="read_sglang",
        # /ready (0.5.20+) reads state; /health runs a one-token generation
        # that takes 1 s and up to 20 s when busy, longer than a poll.
        health="ready",
        health_fallback="health",
        fixed="optional",
        fixed_means="--max-running-requests, for SGLang before 0.5.8 started without it",
        shape="sglang",
        sim_serves="GET /server_info, GET /get_server_info, GET /health",
        tokens="/v1/loads or /server_info max_total_num_tokens, max_req_input_len",
    ),
    ServerKind(
        name="tgi",
        source="tgi",
        reader="read_tgi",
        health="health",
        fixed="optional",
        fixed_means="the running bound (what --max-batch-size or --max-batch-total-tokens "
        "lets run), when below max_concurrent_requests",
        ignores_model=True,  # one model per launcher: the request's model is not routed
        shape="tgi",
        sim_serves="GET /info, GET /health",
        tokens="/info max_total_tokens, max_batch_total_tokens",
    ),
    ServerKind(
        name="lmstudio",
        source="lmstudio",
        reader="read_lmstudio",
        health="api/v1/models",  # no health endpoint: the model list answers when up
        fixed="refused",
        fixed_means="",
        shape="lmstudio",
        sim_serves="GET /api/v1/models",
    ),
    ServerKind(
        name="vllm",
        source="vllm",
        reader="read_vllm",
        health="health",  # 503 when the engine is dead
        fixed="required",
        fixed_means="--max-num-seqs (per data-parallel engine)",
        shape="vllm",
        sim_serves="GET /health, GET /metrics, GET /v1/models",
        tokens="/v1/models max_model_len, /metrics cache_config_info whole blocks",
    ),
    ServerKind(
        name="ollama",
        source="ollama",
        reader="read_ollama",
        health="",  # GET / answers "Ollama is running"
        fixed="required",
        fixed_means="OLLAMA_NUM_PARALLEL, 1 unless set (since 0.9.7)",
        shape="ollama",
        sim_serves="GET /, GET /api/tags, GET /v1/models",
        tokens="/api/ps context_length of the loaded models (one context for all)",
    ),
    ServerKind(
        name="mlx",
        source="mlx",
        reader="read_fixed_checked",
        health="health",
        fixed="required",
        # its BatchGenerator decodes max(completion, prefill batch) at once (generate.py)
        fixed_means="the larger of --decode-concurrency (default 32) and "
        "--prompt-concurrency (default 8); 1 for requests it cannot batch",
    ),
    ServerKind(
        name="localai",
        source="localai",
        reader="read_fixed_checked",
        health="readyz",
        fixed="required",
        fixed_means="the model's parallel option (LocalAI picks it by GPU memory otherwise)",
    ),
    ServerKind(
        name="transformers",
        source="transformers",
        reader="read_fixed",  # its /v1/models lists the hub cache, not what it serves
        health="health",
        fixed="required",
        fixed_means="1, or what --continuous-batching runs at once",
    ),
    ServerKind(
        name="llama-swap",
        source="llama-swap",
        reader="read_llama_swap",
        health="health",
        fixed="optional",
        fixed_means="the model's concurrencyLimit (default 10), and its slots where "
        "/running's cmd has no --parallel",
        shape="llama-swap",
        sim_serves="GET /running, GET /v1/models, GET /health",
    ),
)

BY_NAME: dict[str, ServerKind] = {k.name: k for k in KINDS}
BY_SOURCE: dict[str, ServerKind] = {
    name: k for k in KINDS for name in (k.source, *k.aliases) if name is not None
}
SOURCES: tuple[str, ...] = tuple(BY_SOURCE)
"""Every registry ``source`` name, aliases included."""
SHAPES: tuple[str, ...] = tuple(k.shape for k in KINDS if k.shape is not None)
"""The simulated worker's shapes (``router simworker --shape``)."""
SIM_SERVES: dict[str, str] = {k.shape: k.sim_serves for k in KINDS if k.shape is not None}


def fixed_rule_error(source: str | None, fixed: int | None) -> str | None:
    """Why ``{"source": source, "fixed": fixed}`` is refused, or None when it is fine."""
    if source is None:
        return None if fixed is not None else 'slots must be {"source": KIND} or {"fixed": N}'
    kind = BY_SOURCE.get(source)
    if kind is None:
        return f"unknown source {source!r}; one of {', '.join(SOURCES)}"
    if kind.fixed == "refused" and fixed is not None:
        return f'source {source!r} reads its slots: drop "fixed"'
    if kind.fixed == "required" and fixed is None:
        return (
            f'source {source!r} does not expose its parallelism: add "fixed": N '
            f"({kind.fixed_means})"
        )
    return None


def kind_of(source: str | None) -> ServerKind:
    """The record of a registry ``source`` (a bare ``fixed`` for None)."""
    return BY_NAME["fixed"] if source is None else BY_SOURCE[source]
