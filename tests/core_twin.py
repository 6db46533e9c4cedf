"""A segment driven through the compiled core and, step by step, through its model
(``shm_layout.ledger``), kept byte for byte equal: the pinned cases of the class and token
rules (tests/shm/test_classes_core.py, test_tokens_core.py) run on it."""

from __future__ import annotations

import secrets
from typing import Any

from shm_layout import _core, layout, ledger, lock, rows, writer
from shm_layout.layout import HOLDER, PROVIDER
from shm_layout.segment import Segment, unlink_segment

CODES = {
    _core.ADMIT: "admit",
    _core.WAIT: "wait",
    _core.FULL: "full",
    _core.TOO_LARGE: "too_large",
}


class Twin:
    """A segment driven through the core, and its model, kept byte for byte equal."""

    def __init__(self, limit: int) -> None:
        self.name = "/gwt-c" + secrets.token_hex(5)
        self.seg = Segment.open(self.name)
        writer.ensure_provider(self.seg, "p", limit, layout.Source.PROVIDER, discovery=False)
        self.now = 1000.0
        self.cores: list[Any] = []
        self.kept: list[Any] = []  # a dropped Ticket leaves its record: keep them all
        self.index: list[tuple[int, int]] = []
        self.buf = bytearray(self.seg.buf[: layout.TOTAL_SIZE])
        self.model = ledger.Ledger(self.buf, lambda m: any(i == m for i, _ in self.index))
        self.register()

    def register(self, minor: int = layout.MINOR) -> int:
        core = lock.open_core(self.seg.name, self.seg.buf, self.seg.lock_kind)
        pid = 100 + len(self.cores)
        m, serial = core.register(pid, float(pid), b"gen", layout.MAJOR, minor, self.now)
        taken = {i for i, _ in self.index}
        mm, ms, _ = self.model.register(
            pid, float(pid), b"gen", self.now, lambda x: x in taken, minor=minor
        )
        assert (m, serial) == (mm, ms)
        self.cores.append(core)
        self.index.append((m, serial))
        self.same()
        return len(self.cores) - 1

    def unregister(self, who: int) -> None:
        self.cores[who].unregister(self.now)
        m, serial = self.index[who]
        self.index[who] = (-1, 0)
        self.model.unregister(m, serial, self.now)
        self.same()

    def die(self, who: int) -> None:
        """Process ``who`` is SIGKILLed: its lock byte goes, its records stay."""
        from gwtest import core_hooks

        core_hooks(self.cores[who]).abandon()
        self.index[who] = (-1, 0)

    def classes(self, classes: list[writer.ClassSpec], default: int) -> None:
        self.commit(writer.class_writes(0, classes, default))

    def limit(self, value: int) -> None:
        f = PROVIDER["fallback_limit"]
        self.commit([(rows.provider_base(0) + f.offset, f.codec.pack(value))])

    def publish(self, limit: int, tokens: int, per_request: int = 0, ttl: float = 20.0) -> None:
        """A publication as the writer makes it (token limits before the limit), pumped."""
        base = rows.provider_base(0)
        self.commit(
            [
                (base + PROVIDER[f].offset, PROVIDER[f].codec.pack(v))
                for f, v in (
                    ("expires_mono", self.now + ttl),
                    ("token_limit", tokens),
                    ("request_token_limit", per_request),
                    ("published_limit", limit),
                )
            ]
        )

    def commit(self, writes: list[tuple[int, bytes]]) -> None:
        """A writer's transaction and its pump, on the core and on the model."""
        assert self.seg.core.transact([], writes, True, self.now)
        assert self.model.transact([], writes, self.now)[0]
        self.same()

    def arrive(self, cls: int = -1, who: int = 0, tokens: int = 0) -> tuple[str, Any, Any]:
        ticket = _core.Ticket(tokens=tokens)
        code = self.cores[who].arrive(
            ticket, 0, 100 + who, self.now, may_wait=True, blocking=True, cls=cls
        )
        m, serial = self.index[who]
        decision, model_ticket, _ = self.model.arrive(
            0, 100 + who, m, serial, self.now, cls=cls, tokens=tokens
        )
        assert CODES[code] == decision
        self.kept.append(ticket)
        self.same()
        return decision, ticket, model_ticket

    def leave(self, held: tuple[str, Any, Any], who: int = 0) -> None:
        _, ticket, model_ticket = held
        self.cores[who].leave(ticket, _core.RELEASED, self.now, blocking=True)
        m, serial = self.index[who]
        self.model.leave(model_ticket, m, serial, "released", self.now)
        self.same()

    def sweep(self) -> None:
        assert self.seg.core.sweep(self.now) == self.model.sweep(self.now)[0]
        self.same()

    def same(self) -> None:
        start = layout.PROVIDERS_BASE
        assert bytes(self.seg.buf[start : layout.TOTAL_SIZE]) == bytes(self.buf[start:])
        for name in ("older_members", "tokenless_members"):
            field = layout.HEADER[name]
            assert field.get(self.seg.buf) == field.get(self.buf), name

    def field(self, name: str) -> int:
        value: int = PROVIDER[name].get(self.seg.buf, rows.provider_base(0))
        return value

    @property
    def tokens_running(self) -> int:
        return self.field("tokens_running")

    def state(self, held: tuple[str, Any, Any]) -> str:
        hb = rows.holder_base(0, held[1].holder)
        return layout.HOLDER_STATES[HOLDER["state"].get(self.seg.buf, hb)]

    def close(self) -> None:
        for core in self.cores:
            core.close()
        self.seg.close()
        unlink_segment(self.name)
