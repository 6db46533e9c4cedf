"""Types of the compiled admission core (``_core.c``)."""

from collections.abc import Sequence

HAVE_ROBUST: int
KIND_ROBUST: int
KIND_FILE: int
BUSY: int
ADMIT: int
WAIT: int
FULL: int
WAIT_REFUSED: int
RELEASED: int
TIMEOUT: int
CANCELLED: int
MUTEX_SIZE: int

class CoreError(OSError): ...

class Ticket:
    @property
    def provider(self) -> int: ...
    @property
    def holder(self) -> int: ...
    @property
    def serial(self) -> int: ...
    @property
    def live(self) -> bool: ...

class Core:
    def __init__(
        self,
        buffer: object,
        offsets: dict[str, int],
        kind: int,
        target: str,
        target_is_shm: bool,
        segment: str,
        stamp: bytes = b"",
    ) -> None: ...
    @property
    def member(self) -> tuple[int, int]: ...
    @property
    def held(self) -> int: ...
    @property
    def busy(self) -> int: ...
    def arrive(
        self,
        ticket: Ticket,
        provider: int,
        pid: int,
        now: float,
        may_wait: bool,
        blocking: bool,
        timeout: float,
    ) -> int: ...
    def leave(self, ticket: Ticket, outcome: int, now: float, blocking: bool) -> int: ...
    def state(self, ticket: Ticket) -> int: ...
    def reap(self, now: float, blocking: bool = ...) -> int: ...
    def pump_all(self, now: float) -> None: ...
    def register(
        self, pid: int, start: float, label: bytes, major: int, minor: int, now: float
    ) -> tuple[int, int]: ...
    def unregister(self, now: float) -> None: ...
    def ensure_provider(
        self, id: bytes, fallback: int, source: int, flags: int, bound: int, reason: bytes
    ) -> tuple[int, int]: ...
    def transact(
        self,
        guards: Sequence[tuple[int, bytes]],
        writes: Sequence[tuple[int, bytes]],
        pump: bool,
        now: float,
    ) -> bool: ...
    def snapshot(self) -> bytes: ...
    def hold_lock(self, dirty: bool = ...) -> None: ...
    def abandon(self) -> None: ...
    def die_in_section(self, running: int) -> None: ...
    def take_repaired(self) -> int: ...
    def close(self) -> None: ...

def init_mutex(buffer: object, offset: int) -> None: ...
def fields() -> tuple[str, ...]: ...
def probe(
    target: str,
    is_shm: bool,
    kind: int,
    members: Sequence[tuple[int, int]],
    stamp: bytes = b"",
) -> list[bool]: ...
