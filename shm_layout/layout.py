"""The binary layout of the segment: every offset and ``struct.Struct`` lives here.

The segment is one POSIX shared-memory object:

    header      HEADER_SIZE bytes
    providers   PROVIDER_COUNT rows of PROVIDER_ROW_SIZE
    holders     PROVIDER_COUNT * HOLDERS_PER_PROVIDER rows of HOLDER_ROW_SIZE
                (provider p owns rows p*HOLDERS_PER_PROVIDER ...)
    members     MEMBER_COUNT rows of MEMBER_ROW_SIZE (registered handler processes)

All integers are little-endian. Strings are UTF-8, NUL-padded. Times are Unix
seconds as IEEE doubles, except process start times, which are an opaque
per-OS value only ever compared for equality (see ``liveness``).

Version rules (R-G2): a reader attaches when the major version matches.
Minor versions only append fields inside the reserved tail of a row or the
header, never move one; a reader ignores what it does not know. Row and
table sizes are in the header; a reader checks that they are its own (the
same major means the same geometry) and refuses the segment otherwise.
docs/DESIGN.md is this file as a byte table.
"""

from __future__ import annotations

import enum
import struct
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:  # a handler's import stays light: no typing or dataclasses at run time
    from typing import Any

MAGIC = b"GWCAPSG\x00"
# 3: owner-checked objects, per-registration doorbell names, deadlines on the host's
#    monotonic clock, records woken by futex, a kernel-held lock and liveness (_core.c);
#    a segment of another major is refused, never read
MAJOR = 3
# 3.1: admission classes (docs/DESIGN.md section 6b) in reserved tails; a 3.0 handler still
#      attaches, and the classes are suspended while one is registered (older_members)
# 3.2: a budget of tokens beside the slots (docs/DESIGN.md section 6c): each provider's
#      token limits and tokens in flight, each record's charge; a 3.1 handler still
#      attaches, and the token budget is suspended while one is registered (tokenless_members)
MINOR = 2
# the most one request may be charged: 96 running records of it still fit a u32 counter
MAX_CHARGE = (1 << 24) - 1

PROVIDER_COUNT = 64
HOLDERS_PER_PROVIDER = 128
QUEUE_BOUND = 32  # R-A2
RUNNING_ROOM = HOLDERS_PER_PROVIDER - QUEUE_BOUND  # the most running records a provider can have
MEMBER_COUNT = 128  # doorbell names ".d0".."d127" fit in names.SUFFIX_ROOM
REPLICA_COUNT = 8

HEADER_SIZE = 1024
PROVIDER_ROW_SIZE = 1536
HOLDER_ROW_SIZE = 64
MEMBER_ROW_SIZE = 128

ID_BYTES = 64
REASON_BYTES = 128

SWEEP_S = 0.5  # a sweep for dead holders and damage at least this often (R-A5); the
# longest a waiter sleeps without looking
STAMP_AT = 4096  # where a lock file holds its segment's stamp (lock bytes are 0..256)


class Field:
    """One field of a table: where it is in its row, and how it is packed."""

    __slots__ = ("codec", "offset")

    def __init__(self, offset: int, codec: struct.Struct) -> None:
        self.offset = offset
        self.codec = codec

    def __repr__(self) -> str:
        return f"Field(offset={self.offset}, format={self.codec.format!r})"

    def get(self, buf: Any, base: int = 0) -> Any:
        return self.codec.unpack_from(buf, base + self.offset)[0]

    def put(self, buf: Any, value: Any, base: int = 0) -> None:
        self.codec.pack_into(buf, base + self.offset, value)


def _fields(size: int, spec: list[tuple[str, str]]) -> dict[str, Field]:
    """Lay ``spec`` out in order, each field aligned to its own size (max 8)."""
    out: dict[str, Field] = {}
    offset = 0
    for name, fmt in spec:
        codec = struct.Struct("<" + fmt)
        align = min(codec.size, 8) if not fmt.endswith("s") else 1
        offset = (offset + align - 1) // align * align
        if not name.startswith("_"):
            out[name] = Field(offset, codec)
        offset += codec.size
    if offset > size:
        raise AssertionError(f"layout overflow: {offset} > {size}")
    return out


# --- header ---------------------------------------------------------------------------------
HEADER = _fields(
    HEADER_SIZE,
    [
        ("magic", "8s"),
        ("major", "H"),
        ("minor", "H"),
        ("header_size", "I"),
        ("provider_row_size", "I"),
        ("provider_count", "I"),
        ("holder_row_size", "I"),
        ("holders_per_provider", "I"),
        ("member_row_size", "I"),
        ("member_count", "I"),
        ("total_size", "Q"),
        ("init_complete", "I"),  # INIT_MARK once everything else is written (R-G2)
        ("flags", "I"),  # FLAG_GROUP_SHARED
        ("created_at", "d"),
        ("creator_pid", "I"),
        ("lock_kind", "I"),  # LOCK_* below: which lock every process of this segment uses
        ("creator_start", "d"),
        # the lock (lock.py, _core.c)
        ("dirty", "I"),  # 1 while a lock holder is inside a section: a death there => repair
        ("repairs", "I"),  # repairs after a holder died inside a section (R-A6), for inspect
        ("lock_seq", "Q"),  # +1 on every acquisition
        ("change_seq", "Q"),  # odd while a lock holder may be mid-write (readers retry)
        # the single writer of limits (R-G4)
        ("writer_epoch", "Q"),
        ("sidecar_pid", "I"),
        ("sidecar_state", "I"),  # SIDECAR_* below
        ("sidecar_start", "d"),
        ("heartbeat", "d"),
        ("config_generation", "Q"),
        ("refresh_s", "d"),
        ("legacy_alive", "I"),  # awaited legacy processes still alive (R-G3)
        ("config_status", f"{REASON_BYTES}s"),
        ("config_path", "256s"),
        # layout 3: time on the deadline clock (platform.deadline_now(): monotonic, counts
        # suspend, one clock for the whole host), so a step of the wall clock moves nothing
        ("heartbeat_mono", "d"),  # the sidecar's last heartbeat
        ("sweep_mono", "d"),  # the last sweep for dead holders and damage, by anyone (R-A5)
        ("damage_repairs", "I"),  # sweeps that found counters or records damaged (R-A16)
        ("damage_mono", "d"),  # when the last of them ran (deadline clock)
        ("damage_note", "64s"),  # what it found, for inspect
        # a legacy drain (R-G3) that outlasts --await-legacy-max fails availability --check
        ("legacy_since", "d"),  # when the drain began (deadline clock), 0 while none
        ("legacy_max_s", "d"),  # --await-legacy-max
        ("legacy_pid", "I"),  # one legacy process still awaited (the first), 0 none
        # layout 3.1: registered handlers that speak an older minor (no classes): while
        # any is, every provider admits as one FIFO (DESIGN.md section 6b)
        ("older_members", "I"),
        # layout 3.2: registered handlers that speak a minor below 3.2 (no tokens): while
        # any is, admission is on slots alone (DESIGN.md section 6c)
        ("tokenless_members", "I"),
    ],
)
# The robust mutex of LOCK_ROBUST lives at a fixed, 64-byte aligned place at the end of
# the header (pthread_mutex_t is 40 bytes on Linux; the field leaves room for any libc).
MUTEX_OFFSET = 896
MUTEX_SIZE = HEADER_SIZE - MUTEX_OFFSET
assert max(f.offset + f.codec.size for f in HEADER.values()) <= MUTEX_OFFSET
LOCK_ROBUST = 1  # a process-shared robust pthread mutex in the header (Linux)
LOCK_FILE = 2  # an fcntl record lock on a lock file beside the segment (macOS; forced in tests)
LOCK_KINDS = {LOCK_ROBUST: "robust-mutex", LOCK_FILE: "lock-file"}
INIT_MARK = 0x494E4954  # "INIT"
FLAG_GROUP_SHARED = 1

SIDECAR_NONE = 0
SIDECAR_RUNNING = 1
SIDECAR_STOPPED = 2
SIDECAR_STATES = {
    SIDECAR_NONE: "none",
    SIDECAR_RUNNING: "running",
    SIDECAR_STOPPED: "stopped",
}

# --- provider rows ------------------------------------------------------------------------
PROVIDER = _fields(
    PROVIDER_ROW_SIZE,
    [
        ("in_use", "I"),  # 1 once the row is claimed; rows are never moved or reused
        ("flags", "I"),  # PFLAG_*
        ("id", f"{ID_BYTES}s"),
        ("fallback_limit", "i"),
        ("fallback_source", "I"),  # SOURCE_* code
        ("published_limit", "i"),  # -1: nothing published (use the fallback)
        ("published_source", "I"),
        ("published_at", "d"),
        ("observed_at", "d"),  # oldest observed_at behind the published limit
        ("expires_at", "d"),  # when the published limit expires, wall clock: for people
        ("published_epoch", "Q"),
        ("discovered", "i"),  # last discovered value, -1 none (informational)
        ("queue_bound", "I"),
        ("running", "I"),  # derived from holder records; repaired from them (R-A6)
        ("waiting", "I"),
        ("next_ticket", "Q"),  # FIFO order of arrival (R-A3)
        ("admitted_total", "Q"),
        ("rejected_total", "Q"),
        ("timeouts_total", "Q"),
        ("cancelled_total", "Q"),
        ("reclaimed_total", "Q"),
        ("peak_running", "I"),
        ("peak_waiting", "I"),
        ("reason", f"{REASON_BYTES}s"),
        ("replica_count", "I"),
        # layout 3.2, in the alignment gap before hold_mean_s (no older writer touches it):
        # the charges of the RUNNING records, derived from them like ``running`` and
        # recounted by every sweep (DESIGN.md section 6c)
        ("tokens_running", "I"),
        # decayed mean of how long a running slot is held (set by the core on release):
        # what an honest Retry-After is computed from (REQUIREMENTS section 8)
        ("hold_mean_s", "d"),
        # the published limit is ignored from this deadline on (R-L7): deadline clock
        ("expires_mono", "d"),
        # ~(waiting << 32 | running), written with them: a single bad write to either
        # counter is seen at the next step and the counters recounted, never obeyed (R-A16)
        ("counts_check", "Q"),
        # layout 3.1: admission classes (DESIGN.md section 6b); 0 classes: one FIFO
        ("class_count", "I"),  # class rows in use, at most CLASS_COUNT
        ("default_class", "I"),  # the class of a request that names none
        ("promoted_total", "Q"),  # grants that only a waiter's promotion (maxWait) allowed
        ("displaced_total", "Q"),  # waiters displaced from a full queue by a higher class
        # layout 3.2: the token budget, published with the limit and expiring with it
        ("token_limit", "I"),  # what all running requests may hold together; 0 none
        ("request_token_limit", "I"),  # the most one request may hold; 0 unknown
    ],
)


# the provider's counters since the segment was created (inspect's "counters")
PROVIDER_COUNTERS = (
    "admitted_total",
    "rejected_total",
    "timeouts_total",
    "cancelled_total",
    "reclaimed_total",
    "peak_running",
    "peak_waiting",
    "promoted_total",
    "displaced_total",
)


def counts_check(running: int, waiting: int) -> int:
    """The value ``counts_check`` holds beside ``running`` and ``waiting``."""
    return ~((waiting << 32) | running) & 0xFFFFFFFFFFFFFFFF


PFLAG_DISCOVERY = 1  # capacityDiscovery requested in the config
PFLAG_CONFIGURED = 2  # present in the config the writer last read
PFLAG_CLAMPED = 4  # configured static limit was above RUNNING_ROOM

# --- class rows (layout 3.1), inside a provider row, highest class first ---------------
CLASS_BASE = 384
CLASS_COUNT = 4
CLASS_ROW_SIZE = 32
CLASS_NAME_BYTES = 16
CLASS = _fields(
    CLASS_ROW_SIZE,
    [
        ("name", f"{CLASS_NAME_BYTES}s"),
        ("reserve", "H"),  # slots no lower class may take
        ("cap", "H"),  # the most this class runs at once; 0 none
        ("max_wait_ms", "I"),  # a waiter of this class is promoted after this; 0 never
        ("admitted_total", "Q"),  # admissions of this class
    ],
)
assert max(f.offset + f.codec.size for f in PROVIDER.values()) <= CLASS_BASE

REPLICA_BASE = 512  # replica rows start here inside a provider row
REPLICA_ROW_SIZE = 128
REPLICA = _fields(
    REPLICA_ROW_SIZE,
    [
        ("address", "48s"),
        ("ok", "B"),
        ("complete", "B"),
        ("value", "i"),  # -1: none
        ("observed_at", "d"),  # 0: none
        ("reason", "64s"),
    ],
)
assert CLASS_BASE + CLASS_COUNT * CLASS_ROW_SIZE <= REPLICA_BASE
assert REPLICA_BASE + REPLICA_COUNT * REPLICA_ROW_SIZE <= PROVIDER_ROW_SIZE


class Source(enum.StrEnum):
    """Where a limit comes from (R-L9): the one spelling of each, everywhere."""

    DISCOVERED = "discovered"
    PROVIDER = "provider"  # the fallback: the provider's maxConcurrent
    GATEWAY = "gateway"  # the fallback: the gateway's maxConcurrent
    DEFAULT = "default"  # the fallback: neither is set
    LEGACY_DRAIN = "legacy_drain"
    SHARE = "share"  # this gateway's share of the discovered capacity (docs/share.md)


FALLBACK_SOURCES: Final = (Source.PROVIDER, Source.GATEWAY, Source.DEFAULT)
SOURCE_NONE = 0
SOURCES: Final = {
    1: Source.DISCOVERED,
    2: Source.PROVIDER,
    3: Source.GATEWAY,
    4: Source.DEFAULT,
    5: Source.LEGACY_DRAIN,
    6: Source.SHARE,
}
SOURCE_CODES: Final[dict[str, int]] = {source: code for code, source in SOURCES.items()}

# --- holder rows --------------------------------------------------------------------------
HOLDER = _fields(
    HOLDER_ROW_SIZE,
    [
        ("state", "I"),  # HOLDER_* below; written last when claiming
        ("pid", "I"),  # informational: liveness comes from the member's lock
        ("member_serial", "Q"),  # the owner's registration (member row serial)
        ("ticket", "Q"),
        ("serial", "Q"),  # bumped on every claim: a stale handle cannot touch a reused row
        ("member", "i"),  # member row (liveness lock and doorbell) of the owner
        # layout 3.2, in the alignment gap before ``since`` (no older writer touches it):
        # the tokens this record is charged (0: slots only), counted while it runs
        ("tokens", "I"),
        ("since", "d"),  # when it started waiting, or was admitted (wall clock, for people)
        ("since_mono", "d"),  # the same on the deadline clock (hold times, Retry-After)
        ("waker", "I"),  # WAKE_* below: how the owner is told of its grant
        # layout 3.1: 1 + the record's admission class (0: the default class, resolved when
        # read; always 0 without classes), and 1 once it was
        # displaced from a full queue by a higher class (its owner's wait ends QueueFull)
        ("cls", "B"),
        ("displaced", "B"),
    ],
)
WAKE_DOORBELL = 0  # post the owner's doorbell; its dispatcher looks (async waiters, macOS)
WAKE_FUTEX = 1  # futex-wake this record's state word: its thread waits on it (Linux)
HOLDER_FREE = 0
HOLDER_WAITING = 1
HOLDER_RUNNING = 2
HOLDER_STATES = {HOLDER_FREE: "free", HOLDER_WAITING: "waiting", HOLDER_RUNNING: "running"}

# --- member rows (registered handler processes: R-G1) --------------------------------------
MEMBER = _fields(
    MEMBER_ROW_SIZE,
    [
        ("in_use", "I"),
        ("pid", "I"),  # as its own PID namespace sees it: informational
        ("start", "d"),
        ("serial", "Q"),  # bumped on every registration of the row
        ("major", "H"),
        ("minor", "H"),
        ("attached_at", "d"),
        ("label", f"{ID_BYTES}s"),
        # random, per registration: the doorbell is named names.doorbell_name(bell); nobody
        # who cannot read the segment can guess it (R-G6), and no other segment's or
        # registration's process ever posts it (R-A15)
        ("bell", "Q"),
    ],
)

# Hot-path codecs: several adjacent fields in one call. Each is checked against the
# field table above, so they can never disagree with it.
ADMISSION_BLOCK = struct.Struct("<iIiIdddQiIII")  # fallback_limit .. waiting
ADMISSION_BLOCK_OFFSET = PROVIDER["fallback_limit"].offset
HOLD_MEAN_WEIGHT = 0.2  # of the newest hold time in hold_mean_s (the core uses the same)
COUNTS = struct.Struct("<II")  # running, waiting
COUNTS_OFFSET = PROVIDER["running"].offset
HOLDER_BODY = struct.Struct("<IQQQiIddIBB")  # pid .. displaced
HOLDER_BODY_OFFSET = HOLDER["pid"].offset


def _check_block(codec: struct.Struct, offset: int, table: dict[str, Field], names: str) -> None:
    """``codec`` at ``offset`` must be exactly these fields in order, gaps as padding."""
    expected = "<"
    at = offset
    for name in names.split():
        field = table[name]
        if field.offset > at:
            expected += f"{field.offset - at}x"
        expected += field.codec.format.lstrip("<")
        at = field.offset + field.codec.size
    assert codec.format == expected, (codec.format, expected)


_check_block(
    ADMISSION_BLOCK,
    ADMISSION_BLOCK_OFFSET,
    PROVIDER,
    "fallback_limit fallback_source published_limit published_source published_at observed_at "
    "expires_at published_epoch discovered queue_bound running waiting",
)
_check_block(COUNTS, COUNTS_OFFSET, PROVIDER, "running waiting")
_check_block(
    HOLDER_BODY,
    HOLDER_BODY_OFFSET,
    HOLDER,
    "pid member_serial ticket serial member tokens since since_mono waker cls displaced",
)

PROVIDERS_BASE = HEADER_SIZE
HOLDERS_BASE = PROVIDERS_BASE + PROVIDER_COUNT * PROVIDER_ROW_SIZE
MEMBERS_BASE = HOLDERS_BASE + PROVIDER_COUNT * HOLDERS_PER_PROVIDER * HOLDER_ROW_SIZE
TOTAL_SIZE = MEMBERS_BASE + MEMBER_COUNT * MEMBER_ROW_SIZE


def encode_text(text: str, size: int) -> bytes:
    """UTF-8, cut on a character boundary to fit ``size`` bytes."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= size:
        return raw
    return raw[:size].decode("utf-8", "ignore").encode("utf-8")


def decode_text(raw: bytes) -> str:
    return raw.split(b"\x00", 1)[0].decode("utf-8", "replace")


def core_offsets() -> dict[str, int]:
    """What ``_core.Core`` needs to know of this layout: every offset it touches."""
    out = {f"h.{n}": f.offset for n, f in HEADER.items()}
    out["h.mutex"] = MUTEX_OFFSET
    out.update({f"p.{n}": f.offset for n, f in PROVIDER.items()})
    out.update({f"k.{n}": f.offset for n, f in HOLDER.items()})
    out.update({f"m.{n}": f.offset for n, f in MEMBER.items()})
    out.update({f"c.{n}": f.offset for n, f in CLASS.items()})
    out.update(
        {
            "g.providers_base": PROVIDERS_BASE,
            "g.provider_row_size": PROVIDER_ROW_SIZE,
            "g.provider_count": PROVIDER_COUNT,
            "g.holders_base": HOLDERS_BASE,
            "g.holder_row_size": HOLDER_ROW_SIZE,
            "g.holders_per_provider": HOLDERS_PER_PROVIDER,
            "g.members_base": MEMBERS_BASE,
            "g.member_row_size": MEMBER_ROW_SIZE,
            "g.member_count": MEMBER_COUNT,
            "g.running_room": RUNNING_ROOM,
            "g.queue_bound": QUEUE_BOUND,
            "g.header_size": HEADER_SIZE,
            "g.id_bytes": ID_BYTES,
            "g.reason_bytes": REASON_BYTES,
            "g.label_bytes": ID_BYTES,
            "g.total_size": TOTAL_SIZE,
            "g.mutex_size": MUTEX_SIZE,
            "g.class_base": CLASS_BASE,
            "g.class_count": CLASS_COUNT,
            "g.class_row_size": CLASS_ROW_SIZE,
        }
    )
    return out
