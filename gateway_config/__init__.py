"""The gateway's JSON config file as data: read-only, its types, and the fallback limit.

What every reader of the file shares: the handlers (``handler_shim``), the sidecar
(``sidecar.config`` adds the opt-in checks on top) and the example gateway. The file
belongs to the gateway: it is opened read-only and never written, renamed or touched
(R-C1). Unknown fields anywhere are ignored, so a newer gateway's additions never
break us.

A file that cannot be read, is not JSON, is not an object, or whose top-level
``maxConcurrent``/``providers`` have the wrong type raises :class:`ConfigError`.
Inside, each provider entry stands alone (R-C3):

- an entry without a usable ``id`` (a string of 1..64 UTF-8 bytes without control
  characters: the shared segment stores ids in 64 bytes), or repeating an earlier id,
  cannot be admitted for at all; it is listed in :attr:`ConfigFile.skipped` with the
  reason;
- an entry with a wrongly typed field is kept for static admission with what can be
  trusted (its id and, when valid, its own ``maxConcurrent``), and
  :attr:`ConfigFile.invalid` says what is wrong with it;
- an entry whose ``classes``/``defaultClass`` are wrong (alone or together) loses its
  classes only: it is kept with everything else as written and admits as one queue,
  and :attr:`ConfigFile.class_problems` lists every problem.

Imports msgspec and nothing of ours but the error root: a handler reads its config
without the sidecar's address, credential or probe machinery.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import msgspec

from shm_layout.errors import ConfigError as ConfigError
from shm_layout.layout import Source

MAX_PROVIDER_ID_BYTES: Final = 64
MAX_LIMIT: Final = 2**31 - 1  # fits any 32-bit counter in the segment
DEFAULT_FALLBACK: Final = 4  # REQUIREMENTS.md section 5, when neither maxConcurrent is set

LimitSetting = Annotated[int, msgspec.Meta(ge=0, le=MAX_LIMIT)]
Uid = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 2)]
UserName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# R-P1: "peer" asks the local tailscaled (LocalAPI whois) and refuses when it cannot
# vouch; "range-only" is the operator's explicit choice to accept Tailscale addresses on
# their range alone (a Mac with the GUI app has no LocalAPI socket), shown wherever the
# opt-in is shown.
TailnetCheck = Literal["peer", "range-only"]
RANGE_ONLY: Final = "range-only"
UpstreamModelId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
FallbackSource = Source  # one of layout.FALLBACK_SOURCES

# Editors on Windows (and PowerShell's Out-File) start UTF-8 files with a BOM; JSON
# forbids it (RFC 8259 section 8.1) but allows a parser to ignore it, as we do.
UTF8_BOM: Final = b"\xef\xbb\xbf"

__all__ = [
    "CLASSES_REFUSED",
    "CLASS_FIELDS",
    "CLASS_KEYS",
    "DEFAULT_FALLBACK",
    "ENTRY_FIELDS",
    "MAX_LIMIT",
    "MAX_PROVIDER_ID_BYTES",
    "RANGE_ONLY",
    "TOP_LEVEL_FIELDS",
    "UTF8_BOM",
    "AdmissionClass",
    "ConfigError",
    "ConfigFile",
    "EntryProblem",
    "FallbackSource",
    "LimitSetting",
    "ProviderConfig",
    "TailnetCheck",
    "Uid",
    "UpstreamModelId",
    "UserName",
    "class_problems",
    "fallback_for",
    "field_message",
    "known_providers",
    "parse_config_file",
    "read_config_file",
]


ClassName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,16}$")]
MAX_CLASSES: Final = 4  # the segment's class rows per provider (shm_layout.layout.CLASS_COUNT)
MAX_CLASS_SLOTS: Final = 96  # a reserve or cap beyond the segment's running room means nothing


class AdmissionClass(msgspec.Struct, kw_only=True, frozen=True, rename="camel"):
    """One admission class of a provider (docs/classes.md): ``reserve`` slots no lower
    class may take, at most ``cap`` running at once, promoted after ``maxWait`` seconds."""

    name: ClassName
    reserve: Annotated[int, msgspec.Meta(ge=0, le=MAX_CLASS_SLOTS)] = 0
    cap: Annotated[int, msgspec.Meta(ge=1, le=MAX_CLASS_SLOTS)] | None = None
    max_wait: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = None

    @property
    def spec(self) -> tuple[str, int, int, int]:
        """(name, reserve, cap or 0, maxWait in ms or 0): the segment's class row."""
        wait_ms = 0 if self.max_wait is None else max(round(self.max_wait * 1000), 1)
        return (self.name, self.reserve, self.cap or 0, wait_ms)


class ProviderConfig(msgspec.Struct, kw_only=True, frozen=True, rename="camel"):
    """One entry of ``providers`` (JSON names in camelCase: ``baseUrl``, ``maxConcurrent``...).

    ``models`` maps gateway alias -> upstream model id; capacity rows are
    matched on the upstream ids (R-C2).
    """

    id: str
    type: str | None = None
    base_url: str | None = None
    tailnet: bool = False
    credential_file: str | None = None
    capacity_discovery: bool = False
    max_concurrent: LimitSetting | None = None
    models: dict[str, UpstreamModelId] = {}
    tailnet_check: TailnetCheck = "peer"
    # loopback only: who must own the socket listening on the router's port before the
    # key is sent there (R-P7; capacity_contract/listeners.py)
    listener_owner: Uid | UserName | None = None
    # admission classes, highest first (docs/classes.md); none: one FIFO
    classes: Annotated[tuple[AdmissionClass, ...], msgspec.Meta(max_length=MAX_CLASSES)] = ()
    default_class: ClassName | None = None  # absent: the last (lowest) class

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError("classes: every class needs a name of its own")
        if self.classes and self.default_class is not None and self.default_class not in names:
            raise ValueError(f"defaultClass {self.default_class!r} is not one of the classes")

    @property
    def upstream_models(self) -> frozenset[str]:
        return frozenset(self.models.values())

    @property
    def class_specs(self) -> tuple[tuple[str, int, int, int], ...]:
        """The classes as the segment's class rows hold them, highest first."""
        return tuple(c.spec for c in self.classes)

    @property
    def default_class_index(self) -> int:
        names = [c.name for c in self.classes]
        if self.default_class is None or not names:
            return max(len(names) - 1, 0)
        return names.index(self.default_class)


ENTRY_FIELDS: Final = frozenset(ProviderConfig.__struct_encode_fields__)
# The keys of the top level that are ours (``parse_config_file`` reads them); every other
# top-level key is the gateway's.
TOP_LEVEL_FIELDS: Final = frozenset({"maxConcurrent", "providers", "capacityShare"})


@dataclass(frozen=True, slots=True)
class EntryProblem:
    """Why a provider entry was kept with its id and own ``maxConcurrent`` only."""

    discovery_requested: bool  # ``capacityDiscovery`` was given, true or mistyped ("yes")
    reason: str  # "field: expected ...", from msgspec


# A provider's keys that hold its admission classes: a mistake in them costs the classes
# (the provider admits as one queue), never the rest of the entry (discovery, its limit).
CLASS_KEYS: Final = ("classes", "defaultClass")
CLASS_FIELDS: Final = frozenset(AdmissionClass.__struct_encode_fields__)
# How the sidecar's config status and its log say it when the file is fine but the
# classes of a provider were refused (``availability`` shows it, ``--check`` fails on it)
CLASSES_REFUSED: Final = "classes refused"


@dataclass(frozen=True, slots=True)
class ConfigFile:
    source: str  # the path read, for messages
    max_concurrent: int | None  # the gateway-wide fallback (R-C2)
    providers: tuple[ProviderConfig, ...]  # file order, one per usable id
    invalid: Mapping[str, EntryProblem]  # by provider id: entries kept in part
    skipped: tuple[str, ...]  # entries that have no usable id, with the reason
    # ``capacityShare`` as written, for the sidecar to judge (share mode, docs/share.md);
    # handlers never read it
    capacity_share: Any = None
    # the whole document as decoded, for the sidecar's check of unknown keys
    document: Any = None
    # by provider id: every problem of its ``classes``/``defaultClass``; such a provider
    # is kept with no classes (one queue), everything else of its entry as written
    class_problems: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def provider(self, provider_id: str) -> ProviderConfig | None:
        for p in self.providers:
            if p.id == provider_id:
                return p
        return None


def fallback_for(provider_max: int | None, gateway_max: int | None) -> tuple[int, FallbackSource]:
    """``provider.maxConcurrent ?? gateway.maxConcurrent ?? 4`` and its source name.

    The one home of the fallback chain: the daemon, the handlers (before any
    sidecar ran) and ``check-config`` all ask here. 0 is a real setting, not "unset".
    """
    if provider_max is not None:
        return provider_max, Source.PROVIDER
    if gateway_max is not None:
        return gateway_max, Source.GATEWAY
    return DEFAULT_FALLBACK, Source.DEFAULT


def read_config_file(path: str | os.PathLike[str]) -> ConfigFile:
    """Read the gateway's config file (read-only; R-C1) and type its entries (R-C3)."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config {source}: {exc.strerror or exc}") from None
    return parse_config_file(data, source)


_AT_BYTE: Final = re.compile(r"\(byte (\d+)\)$")


def json_error_text(error: str, data: bytes) -> str:
    """msgspec's decode error with its byte offset given as the line and column an editor
    shows (both from 1; the column counts characters); a truncated document is placed
    where it ends."""
    found = _AT_BYTE.search(error)
    if found is not None:
        offset = min(int(found.group(1)), len(data))
        # "is not valid JSON" says it already; the segment keeps 128 bytes of the status
        error = error[: found.start()].rstrip().removeprefix("JSON is malformed: ")
    elif "truncated" in error:
        if not data.strip():
            return "the file is empty"
        offset = len(data.rstrip())
        error = "JSON ends early (a brace, bracket or string is not closed)"
    else:
        return error
    line_start = data.rfind(b"\n", 0, offset) + 1
    line = data.count(b"\n", 0, offset) + 1
    column = len(data[line_start:offset].decode("utf-8", "replace")) + 1
    return f"{error} at line {line}, column {column}"


def parse_config_file(data: bytes, source: str = "<config>") -> ConfigFile:
    text = data.removeprefix(UTF8_BOM)
    try:
        doc = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError(
            f"config {source} is not valid JSON: {json_error_text(str(exc), text)}"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config {source}: the top level must be a JSON object")
    try:
        gateway_max = msgspec.convert(doc.get("maxConcurrent"), LimitSetting | None, strict=True)
    except msgspec.ValidationError:
        raise ConfigError(
            f"config {source}: top-level maxConcurrent must be an integer 0..{MAX_LIMIT} or absent"
        ) from None
    entries = doc.get("providers")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise ConfigError(f"config {source}: providers must be a JSON array")

    providers: list[ProviderConfig] = []
    invalid: dict[str, EntryProblem] = {}
    seen: set[str] = set()
    skipped: list[str] = []
    wrong_classes: dict[str, tuple[str, ...]] = {}
    for index, entry in enumerate(entries):
        where = f"providers[{index}]"
        if not isinstance(entry, dict):
            skipped.append(f"{where}: not a JSON object")
            continue
        provider_id = entry.get("id")
        problem = _id_problem(provider_id)
        if problem is not None:
            skipped.append(f"{where}: {problem}")
            continue
        assert isinstance(provider_id, str)
        if provider_id in seen:
            skipped.append(f"{where}: duplicate id {provider_id!r} (the first entry is used)")
            continue
        seen.add(provider_id)
        classes_wrong = tuple(class_problems(entry))
        provider, entry_problem = _typed_entry(provider_id, entry, classes_wrong)
        providers.append(provider)
        if entry_problem is not None:
            invalid[provider_id] = entry_problem
        if classes_wrong:
            wrong_classes[provider_id] = classes_wrong
    return ConfigFile(
        source,
        gateway_max,
        tuple(providers),
        invalid,
        tuple(skipped),
        doc.get("capacityShare"),
        doc,
        wrong_classes,
    )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    return {dict: "object", list: "array", str: "str", int: "int", float: "float"}.get(
        type(value), type(value).__name__
    )


def class_problems(entry: Mapping[str, Any]) -> list[str]:
    """Every problem of a provider entry's ``classes`` and ``defaultClass``, each naming
    its field (``classes[1].reserve: ...``), not just the first: one edit fixes them all.
    Keys that are not a class's are not problems here (the sidecar's unknown-key check
    names them, with the key they resemble)."""
    problems: list[str] = []
    classes = entry.get("classes", [])
    if not isinstance(classes, list):
        problems.append(f"classes: expected an array of class objects, got {_json_type(classes)}")
        classes = []
    elif len(classes) > MAX_CLASSES:
        problems.append(
            f"classes: at most {MAX_CLASSES} classes (the segment's rows), got {len(classes)}"
        )
    names: list[str] = []
    for index, item in enumerate(classes):
        where = f"classes[{index}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: expected an object, got {_json_type(item)}")
            continue
        if "name" not in item:
            problems.append(f"{where}: name is required")
        for key, value in item.items():
            if key not in CLASS_FIELDS:
                continue
            alone = {key: value} if key == "name" else {"name": "x", key: value}
            try:
                msgspec.convert(alone, AdmissionClass, strict=True)
            except msgspec.ValidationError as exc:
                problems.append(f"{where}.{field_message(str(exc))}")
            else:
                if key == "name":
                    names.append(value)
    for name in sorted({n for n in names if names.count(n) > 1}, key=names.index):
        problems.append(
            f"classes: the name {name!r} is given {names.count(name)} times "
            "(every class needs a name of its own)"
        )
    if "defaultClass" in entry:
        default = entry["defaultClass"]
        try:
            msgspec.convert({"id": "x", "defaultClass": default}, ProviderConfig, strict=True)
        except msgspec.ValidationError as exc:
            problems.append(field_message(str(exc)))
        else:
            if names and default is not None and default not in names:
                near = difflib.get_close_matches(default, names, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                problems.append(
                    f"defaultClass {default!r} is not one of the classes "
                    f"({', '.join(dict.fromkeys(names))}){hint}"
                )
    return problems


def field_message(message: str) -> str:
    """msgspec's "Expected `bool`, got `str` - at `$.tailnet`" as "tailnet: expected ..."."""
    text, sep, where = message.partition(" - at `")
    if not sep:
        return message
    field = where.rstrip("`").removeprefix("$.").removeprefix("$")
    return f"{field}: {text[:1].lower()}{text[1:]}"


def known_providers(wanted: str, known: list[str], *, none: str = "none yet") -> str:
    """What follows "no provider ``wanted``" in every message that names one: the
    nearest id, then every id there is (``none`` when there is none)."""
    near = difflib.get_close_matches(wanted, known, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"{hint} (its providers: {', '.join(known) if known else none})"


def _id_problem(value: Any) -> str | None:
    if not isinstance(value, str):
        return "id is missing or not a string (entry skipped)"
    size = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= MAX_PROVIDER_ID_BYTES:
        return f"id must be 1..{MAX_PROVIDER_ID_BYTES} bytes of UTF-8, got {size} (entry skipped)"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        return "id contains control characters (entry skipped)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "id is not valid UTF-8 (entry skipped)"
    return None


def _typed_entry(
    provider_id: str, entry: dict[str, Any], classes_wrong: tuple[str, ...]
) -> tuple[ProviderConfig, EntryProblem | None]:
    if classes_wrong:  # the classes go, the rest of the entry stands on its own
        entry = {k: v for k, v in entry.items() if k not in CLASS_KEYS}
    try:
        return msgspec.convert(entry, ProviderConfig, strict=True), None
    except msgspec.ValidationError as exc:
        # kept for static admission (R-A8) with what can be trusted
        try:
            own_max = msgspec.convert(entry.get("maxConcurrent"), LimitSetting | None, strict=True)
        except msgspec.ValidationError:
            own_max = None
        kept = ProviderConfig(id=provider_id, max_concurrent=own_max)
        # any value but false or null asks for it ("yes"): refused, not "not requested"
        requested = entry.get("capacityDiscovery", False) not in (False, None)
        return kept, EntryProblem(requested, field_message(str(exc)))
