"""Reasons whole: the sidecar's full texts beside the segment's cut ones.

The segment keeps a reason in a fixed field (``layout.REASON_BYTES`` for a provider
and the config status, 64 bytes for a replica), cut on a character boundary. A fix
the operator cannot paste is no fix, so the sidecar also writes every text it had
to cut to a file beside the segment's lock file, ``{lock dir}/{segment}.reasons``
(JSON), and the views show the whole text from there.

Trust, as for the lock file (R-G6): the directory is ``platform.lock_dir()``
(``/dev/shm`` on Linux: sticky, so another user may create a name there first but
never replace ours). The sidecar writes a fresh file under a random name
(``mkstemp``: exclusive, no link followed) and renames it over the name; when
another user got the name first the rename fails, the sidecar says so once and the
views show the cut texts. A reader uses the file only when it is a regular file
(no link followed) owned by the segment's owner, by the reader or by root, not
writable by group or others, and under 256 KiB; and it shows a full text only when
cutting it gives exactly what the segment holds now, so a file left by an earlier
publication never puts words in the segment's mouth. Anything else: the cut text,
marked as cut.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

from shm_layout import layout, platform
from shm_layout.names import reasons_path

if TYPE_CHECKING:
    from shm_layout.view import SegmentView
    from shm_layout.writer import Publication

MAX_FILE_BYTES: Final = 256 * 1024
PROVIDER_REASON_BYTES: Final = layout.PROVIDER["reason"].codec.size
REPLICA_REASON_BYTES: Final = layout.REPLICA["reason"].codec.size
CONFIG_STATUS_BYTES: Final = layout.HEADER["config_status"].codec.size


def was_cut(text: str, size: int) -> bool:
    return len(text.encode("utf-8", "replace")) > size


def matches(full: str, stored: str, size: int) -> bool:
    """Does the segment's ``stored`` text come from cutting ``full`` to ``size`` bytes?"""
    return was_cut(full, size) and layout.encode_text(full, size).decode("utf-8") == stored


@dataclass
class FullTexts:
    """The texts the segment had to cut: the config status, per provider its reason and
    per replica address its reason."""

    config_status: str | None = None
    providers: dict[str, str] = field(default_factory=dict)
    replicas: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = {
            "config_status": self.config_status,
            "providers": self.providers,
            "replicas": self.replicas,
        }
        return json.dumps(doc, sort_keys=True).encode()

    def provider(self, provider_id: str, stored: str) -> str | None:
        full = self.providers.get(provider_id)
        return full if full is not None and matches(full, stored, PROVIDER_REASON_BYTES) else None

    def replica(self, provider_id: str, address: str, stored: str) -> str | None:
        full = self.replicas.get(provider_id, {}).get(address)
        return full if full is not None and matches(full, stored, REPLICA_REASON_BYTES) else None

    def status(self, stored: str) -> str | None:
        full = self.config_status
        return full if full is not None and matches(full, stored, CONFIG_STATUS_BYTES) else None


class ReasonsWriter:
    """The sidecar's side: ``write`` after each publication; the file changes only when
    a cut text does."""

    def __init__(self, segment: str, mode: int) -> None:
        self.path = reasons_path(segment)
        self.mode = mode & 0o644  # readable where the segment is; written by its owner only
        self._last: bytes | None = None

    def write(self, texts: FullTexts) -> str | None:
        """Write ``texts`` unless the file holds them already. Returns why it could not
        (a one-line message with what to do), else None."""
        data = texts.to_json()
        if data == self._last:
            return None
        if not (texts.config_status or texts.providers or texts.replicas):
            self.remove()  # nothing was cut: no file at all, not even an earlier sidecar's
            self._last = data
            return None
        directory = os.path.dirname(self.path)
        try:
            fd, tmp = tempfile.mkstemp(prefix=os.path.basename(self.path) + ".", dir=directory)
        except OSError as exc:
            return self._refusal(exc)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), self.mode)
                f.write(data)
            os.rename(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return self._refusal(exc)
        self._last = data
        return None

    def _refusal(self, exc: OSError) -> str:
        return (
            f"cannot keep whole reasons in {self.path} ({exc.strerror}): availability shows "
            "them cut to the segment's fields. If another user made that file, remove it "
            f"(as root if need be); or set ${platform.LOCK_DIR_ENV} to a directory of this "
            "service's own"
        )

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def read_texts(segment: str, segment_owner: int | None) -> FullTexts:
    """The sidecar's full texts for ``segment``, or none when the file is missing or
    cannot be trusted (see the module's docstring)."""
    trusted = {0, os.geteuid()} | ({segment_owner} if segment_owner is not None else set())
    try:
        fd = os.open(reasons_path(segment), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return FullTexts()
    try:
        info = os.fstat(fd)
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_uid not in trusted
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            or info.st_size > MAX_FILE_BYTES
        ):
            return FullTexts()
        data = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError:
        return FullTexts()
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except ValueError:
        return FullTexts()
    if not isinstance(doc, dict):
        return FullTexts()
    status = doc.get("config_status")
    return FullTexts(
        config_status=status if isinstance(status, str) else None,
        providers=_strings(doc.get("providers")),
        replicas={
            k: _strings(v)
            for k, v in (doc.get("replicas") or {}).items()
            if isinstance(k, str) and isinstance(v, dict)
        }
        if isinstance(doc.get("replicas"), dict)
        else {},
    )


def _strings(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def texts_of(config_status: str, publications: Sequence[Publication]) -> FullTexts:
    """What of a publication the segment's fields cut."""
    texts = FullTexts()
    if was_cut(config_status, CONFIG_STATUS_BYTES):
        texts.config_status = config_status
    for pub in publications:
        if was_cut(pub.reason, PROVIDER_REASON_BYTES):
            texts.providers[pub.provider_id] = pub.reason
        cut = {r.address: r.reason for r in pub.replicas if was_cut(r.reason, REPLICA_REASON_BYTES)}
        if cut:
            texts.replicas[pub.provider_id] = cut
    return texts


def whole(view: SegmentView) -> SegmentView:
    """``view`` with every cut reason that the sidecar's file holds whole put back."""
    from shm_layout.segment import owner_of

    owner = owner_of(view.name)
    texts = read_texts(view.name, owner[0] if owner is not None else None)
    if not (texts.config_status or texts.providers or texts.replicas):
        return view
    providers = []
    for p in view.providers:
        replicas = tuple(
            replace(r, reason=texts.replica(p.id, r.address, r.reason) or r.reason)
            for r in p.replicas
        )
        reason = texts.provider(p.id, p.reason) or p.reason
        providers.append(replace(p, reason=reason, replicas=replicas))
    status = texts.status(view.config_status) or view.config_status
    return replace(view, providers=tuple(providers), config_status=status)
