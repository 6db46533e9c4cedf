"""The worker registry: which workers are *registered* (R-K5), as a JSON file.

```json
{"workers": [
  {"id": "mac-studio-1",
   "urls": ["http://100.101.102.103:8080", "http://mac-studio-1.tailnet.example:8080"],
   "models": ["workhorse", "workhorse-long"],
   "slots": {"source": "props"}},
  {"id": "linux-box", "urls": ["http://10.0.0.7:8000"], "models": ["workhorse"],
   "slots": {"fixed": 4}, "fenced": true}
]}
```

- ``id`` is the worker's identity, opaque to the router. Every URL listed under
  one id reaches the same worker, so its slots count once (R-K5). The same URL
  under two ids is refused: that is one worker counted twice.
- ``models`` are upstream model ids (what the gateway's ``models`` map points
  to). Several ids on one worker are aliases of one scheduler: the worker's
  slots count once for each id.
- ``slots`` names how the worker's slots are read: ``{"source": KIND}`` for
  a server whose own endpoints tell (``capacity_router/kinds.py`` lists the
  kinds, ``capacity_router/sources.py`` their readers), ``{"source": KIND,
  "fixed": N}`` where the kind wants or allows the operator's count (health
  and served ids are still checked), or ``{"fixed": N}`` alone for any worker
  (health only, any non-5xx).
- ``keyFile`` (optional) is a file holding the bearer key of a worker started
  with ``--api-key``; same rules as the router's own key file. A relative
  path is relative to the registry file's directory.
- ``listenerOwner`` (optional, a uid or user name): who must own the listening
  socket of the worker's loopback URLs. A loopback worker is polled and sent
  requests only while its listener belongs to that user, or without the setting
  to root or the router's own user (``capacity_contract.listeners``): while a
  worker is down, anyone may listen on its port.
- ``fenced: true`` drains the worker from the file (survives restarts).

Unknown fields are refused, so a typo such as ``"fence": true`` cannot leave a
worker silently counted. The file is re-read when its identity, size or
timestamps change; a broken edit keeps the last good registry.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Annotated, Final
from urllib.parse import urlsplit

import msgspec

from capacity_contract import (
    MAX_MODELS,
    MAX_SLOTS,
    MAX_SNAPSHOT_BYTES,
    decode_json,
    row_bytes,
    worst_case_snapshot_bytes,
)
from shm_layout.errors import GatewayCapacityError

from .kinds import ServerKind, fixed_rule_error, kind_of
from .watched import FileStamp, open_regular

__all__ = ["RegistryError", "RegistryFile", "RegistryWatcher", "SlotSource", "Worker"]

MAX_REGISTRY_BYTES = 1 << 20
MAX_URLS_PER_WORKER = 16

WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$"
WorkerId = Annotated[
    str,
    msgspec.Meta(
        pattern=WORKER_ID_PATTERN,
        description="opaque identity: letters, digits and . _ : @ + -, at most 128",
    ),
]
ModelId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
WorkerUrl = Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]


class RegistryError(GatewayCapacityError, ValueError):
    """The registry file cannot be used. ``str()`` is a one-line reason."""


class SlotSource(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``source`` (a server kind), ``fixed`` (a count), or both where the kind allows
    (``capacity_router/kinds.py`` says, per kind, whether ``fixed`` is refused,
    required or optional)."""

    source: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    fixed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SLOTS)] | None = None

    def __post_init__(self) -> None:
        error = fixed_rule_error(self.source, self.fixed)
        if error is not None:
            raise ValueError(error)

    @property
    def kind(self) -> str:
        """The server kind's name; ``"fixed"`` for a bare ``{"fixed": N}``."""
        return kind_of(self.source).name

    @property
    def server_kind(self) -> ServerKind:
        """The server kind's record."""
        return kind_of(self.source)


class Worker(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: WorkerId
    urls: Annotated[
        tuple[WorkerUrl, ...], msgspec.Meta(min_length=1, max_length=MAX_URLS_PER_WORKER)
    ]
    models: Annotated[tuple[ModelId, ...], msgspec.Meta(min_length=1, max_length=MAX_MODELS)]
    slots: SlotSource
    fenced: bool = False
    key_file: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = msgspec.field(
        default=None, name="keyFile"
    )
    listener_owner: (
        Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFE)]
        | Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
        | None
    ) = msgspec.field(default=None, name="listenerOwner")


class RegistryFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    workers: tuple[Worker, ...] = ()

    def find(self, worker_id: str) -> Worker | None:
        for worker in self.workers:
            if worker.id == worker_id:
                return worker
        return None


_decoder = msgspec.json.Decoder(RegistryFile, strict=True)


_UNKNOWN_FIELD: Final = re.compile(r"unknown field `(?P<key>[^`]*)` - at `\$(?P<at>[^`]*)`")


def _did_you_mean(reason: str) -> str:
    """``reason`` with the field the unknown one most resembles (``fence``: ``fenced``)."""
    found = _UNKNOWN_FIELD.search(reason)
    if found is None:
        return reason
    at = found["at"]
    struct = SlotSource if at.endswith(".slots") else Worker if at else RegistryFile
    known = [f.encode_name for f in msgspec.structs.fields(struct)]
    near = difflib.get_close_matches(found["key"], known, n=1, cutoff=0.6)
    return f"{reason}; did you mean {near[0]!r}?" if near else reason


def parse_registry(body: bytes) -> RegistryFile:
    """Decode and check a registry file's bytes, or raise :class:`RegistryError`."""
    try:
        registry = decode_json(_decoder, body, RegistryError, "registry")
    except RegistryError as exc:
        raise RegistryError(_did_you_mean(str(exc))) from None
    ids: set[str] = set()
    url_owner: dict[str, str] = {}
    models: set[str] = set()
    for worker in registry.workers:
        if worker.id in ids:
            raise RegistryError(
                f"worker id {worker.id!r} appears twice: list all its URLs in one entry"
            )
        ids.add(worker.id)
        for url in worker.urls:
            key = _url_identity(worker.id, url)
            owner = url_owner.setdefault(key, worker.id)
            if owner != worker.id:
                raise RegistryError(
                    f"url {url!r} is listed under workers {owner!r} and {worker.id!r}: "
                    "one worker must have one id"
                )
        models.update(worker.models)
    if len(models) > MAX_MODELS:
        raise RegistryError(
            f"{len(models)} distinct model ids; a snapshot holds at most {MAX_MODELS}"
        )
    _check_snapshot_size(models)
    return registry


def _check_snapshot_size(models: set[str]) -> None:
    """Refuse ids whose snapshot could pass the contract's size bound (R-P6): every
    reader would refuse it as too large and fall back."""
    size = worst_case_snapshot_bytes(models)
    if size <= MAX_SNAPSHOT_BYTES:
        return
    longest = sorted(models, key=lambda m: (-row_bytes(m), m))
    over, at_fault = size - MAX_SNAPSHOT_BYTES, []
    for model in longest:  # the fewest longest ids whose rows take it back under
        if over <= 0:
            break
        at_fault.append(model)
        over -= row_bytes(model) + 1
    shown = ", ".join(repr(m if len(m) <= 40 else f"{m[:24]}…{m[-12:]}") for m in at_fault[:3])
    more = f" and {len(at_fault) - 3} more" if len(at_fault) > 3 else ""
    raise RegistryError(
        f"the snapshot of these {len(models)} model ids could reach {size} bytes, over the "
        f"contract's {MAX_SNAPSHOT_BYTES}: shorten or drop the longest ({shown}{more})"
    )


def _url_identity(worker_id: str, url: str) -> str:
    """Check a worker URL and return a normalised form for duplicate detection."""
    where = f"worker {worker_id!r}: url {url!r}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RegistryError(f"{where}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise RegistryError(f"{where}: scheme must be http or https")
    if not parts.hostname:
        raise RegistryError(f"{where}: no host")
    if parts.username is not None or parts.password is not None:
        raise RegistryError(f"{where}: credentials in URLs are not supported")
    if parts.query or parts.fragment:
        raise RegistryError(f"{where}: no query or fragment allowed")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return f"{parts.scheme}://{parts.hostname.lower()}:{port}{parts.path.rstrip('/')}"


class RegistryWatcher:
    """Holds the last good registry and re-reads the file when it changes.

    Not thread-safe: one owner (the poller's event loop) calls :meth:`refresh`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._stamp: FileStamp | None = None
        self.current: RegistryFile = self._load_initial()
        self.last_error: str | None = None

    def _load_initial(self) -> RegistryFile:
        stamp, registry = self._read()
        self._stamp = stamp
        return registry

    def _read(self) -> tuple[FileStamp | None, RegistryFile]:
        fd, before = open_regular(self.path, "registry", RegistryError)
        try:
            too_large = f"registry {self.path} is larger than {MAX_REGISTRY_BYTES} bytes"
            if before.st_size > MAX_REGISTRY_BYTES:
                raise RegistryError(too_large)
            chunks: list[bytes] = []
            total = 0
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
                total += len(chunk)
                if total > MAX_REGISTRY_BYTES:
                    raise RegistryError(too_large)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        registry = parse_registry(b"".join(chunks))
        # A file rewritten while we read it: use what we read, but do not
        # remember its stamp, so the finished version is read next time.
        stamp = FileStamp.of(after) if FileStamp.of(before) == FileStamp.of(after) else None
        return stamp, registry

    def refresh(self) -> bool:
        """Re-read the file if it changed. True when a new registry was taken.

        A missing or broken file keeps the last good registry; the reason is in
        :attr:`last_error` until a good version is read.
        """
        try:
            stamp = FileStamp.of(os.stat(self.path))
        except OSError as exc:
            self.last_error = f"cannot stat registry {self.path}: {exc.strerror}"
            return False
        if stamp == self._stamp:
            return False
        try:
            new_stamp, registry = self._read()
        except RegistryError as exc:
            self.last_error = str(exc)
            self._stamp = stamp  # do not re-read the same broken bytes every round
            return False
        self._stamp = new_stamp
        self.last_error = None
        changed = registry != self.current
        self.current = registry
        return changed
