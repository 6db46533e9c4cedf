"""The capacity contract (REQUIREMENTS.md section 4): the wire types a router answers with.

Shared by the gateway side (``sidecar.probe``) and the producer side
(``capacity_router``). Nothing else in the project parses this JSON.

Decoding is strict where the requirements are strict (R-K1..R-K3: types, ranges, row
count) and lenient where it asks for forward compatibility (R-K6: unknown
fields are ignored). Semantic checks that msgspec cannot express (unique ids,
finite ``observed_at``, the literal ``object``/``version``) are in
:func:`decode_snapshot`; freshness (R-K4) depends on the reader's clock and is
checked by :func:`check_freshness`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, Iterable
from typing import Annotated, Final, Literal, TypeVar

import msgspec

from shm_layout.errors import GatewayCapacityError

MAX_MODELS = 128  # R-K2
MAX_SLOTS = 4096  # R-K3
MAX_TOKENS = 2**31 - 1  # R-K7: the token fields' bound
STALE_AFTER_S = 30.0  # R-K4
MAX_FUTURE_S = 5.0  # R-K4
MAX_SNAPSHOT_BYTES = 64 * 1024  # R-P6: a reader refuses a longer body

_T = TypeVar("_T")

SlotCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_SLOTS)]
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]


class ModelCapacity(msgspec.Struct, forbid_unknown_fields=False):
    """One model's row. The token fields are optional (R-K7): absent (``UNSET``) means
    unknown, and the row is written without them; ``null`` is refused like any other
    non-integer. A reader of the first contract ignores them (R-K6)."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    max_concurrent_requests: SlotCount
    max_request_tokens: TokenCount | msgspec.UnsetType = msgspec.UNSET
    max_running_tokens: TokenCount | msgspec.UnsetType = msgspec.UNSET

    @property
    def request_tokens(self) -> int | None:
        """``max_request_tokens``, or None when the row does not say."""
        value = self.max_request_tokens
        return None if isinstance(value, msgspec.UnsetType) else value

    @property
    def running_tokens(self) -> int | None:
        """``max_running_tokens``, or None when the row does not say."""
        value = self.max_running_tokens
        return None if isinstance(value, msgspec.UnsetType) else value


class CapacitySnapshot(msgspec.Struct, forbid_unknown_fields=False):
    object: Literal["inference_capacity"]
    version: Literal[1]
    complete: bool
    observed_at: float
    models: Annotated[list[ModelCapacity], msgspec.Meta(max_length=MAX_MODELS)]


class ContractError(GatewayCapacityError, ValueError):
    """The body is not a valid capacity snapshot. ``str()`` is a short reason."""


# strict=True: no str->int or float->int coercion; msgspec never accepts a bool
# for an int field, nor a float with a fraction; a float like 20.0 is refused
# too because JSON ``20.0`` decodes as float.
_decoder = msgspec.json.Decoder(CapacitySnapshot, strict=True)


def decode_snapshot(body: bytes) -> CapacitySnapshot:
    """Decode and validate a snapshot body (R-K1..R-K4 shape, R-K6)."""
    snap = decode_json(_decoder, body, ContractError, "snapshot")
    if not math.isfinite(snap.observed_at):
        raise ContractError("invalid snapshot: observed_at is not finite")
    seen: set[str] = set()
    for row in snap.models:
        if row.id in seen:
            raise ContractError(f"invalid snapshot: duplicate model id {row.id!r}")
        seen.add(row.id)
    return snap


def check_freshness(snap: CapacitySnapshot, now: float) -> str | None:
    """``None`` when fresh, else ``"stale"`` or ``"future"`` (R-K4)."""
    if snap.observed_at > now + MAX_FUTURE_S:
        return "future"
    if now - snap.observed_at > STALE_AFTER_S:
        return "stale"
    return None


def encode_snapshot(snap: CapacitySnapshot) -> bytes:
    return msgspec.json.encode(snap)


# the longest float msgspec writes (17 significant digits, a sign, a 3-digit exponent)
_LONGEST_FLOAT: Final = -2.2250738585072014e-308


def row_bytes(model_id: str) -> int:
    """The encoded length of ``model_id``'s row at its longest (a 4-digit count, both
    token fields at their 10-digit bound), JSON escaping and UTF-8 included."""
    row = ModelCapacity(
        id=model_id,
        max_concurrent_requests=MAX_SLOTS,
        max_request_tokens=MAX_TOKENS,
        max_running_tokens=MAX_TOKENS,
    )
    return len(msgspec.json.encode(row))


def worst_case_snapshot_bytes(model_ids: Iterable[str]) -> int:
    """The longest snapshot with a row for each of ``model_ids``: ``complete: false``,
    the longest ``observed_at``, every count at 4096 and every token field at its bound."""
    envelope = CapacitySnapshot(
        object="inference_capacity",
        version=1,
        complete=False,
        observed_at=_LONGEST_FLOAT,
        models=[],
    )
    rows = [row_bytes(model_id) for model_id in set(model_ids)]
    return len(encode_snapshot(envelope)) + sum(rows) + max(len(rows) - 1, 0)


# --- what both ends read besides the snapshot ---------------------------------------------

KEY_TRIMMED: Final = b"\r\n "  # R-P7: trailing CR, LF and spaces, nothing else


def bearer_key(raw: bytes) -> bytes:
    """The bearer key in ``raw`` (a key file's bytes or an environment value).

    Trailing CR, LF and spaces are trimmed (R-P7); what is left must be non-empty
    printable ASCII without whitespace. ``ValueError`` says what is wrong in words
    that follow the key's source ("credential file X ..."), never the key itself.
    """
    key = raw.rstrip(KEY_TRIMMED)
    if not key:
        raise ValueError("is empty")
    if any(b < 0x21 or b > 0x7E for b in key):
        raise ValueError("contains whitespace, a control character or non-ASCII inside the key")
    return key


def shown(text: object) -> str:
    """``text`` as one line a terminal prints as it is: control characters (newlines,
    ANSI escapes, bidi marks, anything ``str.isprintable`` refuses) and backslashes
    escaped as Python writes them (``\\n``, ``\\x1b``, ``\\u202e``). For every view and
    log line that shows what a worker or a router said."""
    text = str(text)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        "\\\\" if ch == "\\" else ch if ch.isprintable() else ch.encode("unicode_escape").decode()
        for ch in text
    )


def decode_json(
    decoder: msgspec.json.Decoder[_T], body: bytes, error: type[GatewayCapacityError], what: str
) -> _T:
    """``body`` decoded by ``decoder``, or ``error`` with a short reason: ``invalid
    <what>: ...`` for JSON that breaks the schema, ``invalid JSON: ...`` for bytes that
    are not JSON."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise error(f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise error(f"invalid JSON: {exc}") from None


async def read_capped(chunks: AsyncIterable[bytes], limit: int) -> bytes | None:
    """A body of at most ``limit`` bytes, or ``None`` as soon as it is longer.

    ``chunks`` is the raw (not decoded) stream, e.g. httpx's ``aiter_raw()``;
    reading stops at the first byte over the limit (R-P6).
    """
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
