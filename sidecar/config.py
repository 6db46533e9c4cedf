"""The gateway's JSON config file, read-only (REQUIREMENTS.md section 2, R-C1..R-C3).

The file belongs to the gateway: it is opened read-only and never written,
renamed or touched (R-C1). Unknown fields anywhere are ignored, so a newer
gateway's additions never break us.

A file that cannot be read, is not JSON, is not an object, or whose top-level
``maxConcurrent``/``providers`` have the wrong type raises :class:`ConfigError`
(the CLI turns it into exit 2). Everything inside one provider entry is judged
per provider (R-C3): a bad entry disables discovery for that provider alone and
its :class:`ProviderStatus` says why, in one of these forms:

- ``not_requested``: ``capacityDiscovery`` is not ``true`` (static admission);
- ``opt_in_ok:loopback`` / ``opt_in_ok:tailnet``: eligible; every probe still
  resolves and checks the addresses (``sidecar.addresses``);
- ``opt_in_refused:<why>``: the host may not receive the credential (R-P1);
- ``config_invalid:<why>``: a field has the wrong type or value.

Reading and typing the file is ``gateway_config``'s, which the handlers use alone;
its names are re-exported here for the sidecar and the CLI. An entry without a usable
``id`` is listed in :attr:`GatewayConfig.skipped` with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final
from urllib.parse import urlsplit

import msgspec

from gateway_config import (
    ENTRY_FIELDS,
    MAX_LIMIT,
    MAX_PROVIDER_ID_BYTES,
    RANGE_ONLY,
    UTF8_BOM,
    ConfigError,
    ConfigFile,
    LimitSetting,
    ProviderConfig,
    TailnetCheck,
    Uid,
    UpstreamModelId,
    UserName,
    field_message,
    parse_config_file,
    read_config_file,
)
from sidecar.addresses import classify, is_localhost_name, parse_ip, static_opt_in
from sidecar.credential import check_credential_spec

__all__ = [
    "MAX_LIMIT",
    "MAX_PROVIDER_ID_BYTES",
    "RANGE_ONLY",
    "UTF8_BOM",
    "CapacityShare",
    "ConfigError",
    "Endpoint",
    "GatewayConfig",
    "LimitSetting",
    "ProviderConfig",
    "ProviderStatus",
    "TailnetCheck",
    "Uid",
    "UpstreamModelId",
    "UserName",
    "check_provider",
    "check_share",
    "judge",
    "load_config",
    "parse_base_url",
    "parse_config",
    "provider_problems",
    "raw_provider_entries",
    "redis_url_for_logs",
]


GatewayId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
LeaseSeconds = Annotated[float, msgspec.Meta(ge=1.0, le=300.0)]
ShareFloor = Annotated[int, msgspec.Meta(ge=0, le=64)]


class CapacityShare(msgspec.Struct, kw_only=True, frozen=True, rename="camel"):
    """``capacityShare``: several gateways share each discovered capacity through Redis
    (docs/share.md). Absent: every gateway admits up to the whole capacity (local mode).

    ``redis`` is a ``redis://`` or ``rediss://`` (TLS) URL without a password; the
    password, if any, is read from ``credentialFile`` under the provider key's rules.
    """

    redis: str
    gateway: GatewayId
    credential_file: str | None = None
    lease: LeaseSeconds = 10.0
    floor: ShareFloor = 1


def check_share(share: CapacityShare) -> str | None:
    """``None`` when ``share`` can be used, else why not (no file or network access)."""
    try:
        parts = urlsplit(share.redis)
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as exc:
        return f"redis: not a URL ({exc})"
    if parts.scheme not in ("redis", "rediss"):
        return "redis: must be a redis:// or rediss:// URL"
    if not parts.hostname:
        return "redis: the URL names no host"
    if parts.password is not None or (parts.username and not share.credential_file):
        return "redis: put no password in the URL; use credentialFile (kept out of argv and logs)"
    if share.credential_file is not None:
        return check_credential_spec(share.credential_file)
    return None


def redis_url_for_logs(url: str) -> str:
    """The URL with any userinfo removed, for messages."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"


@dataclass(frozen=True, slots=True)
class ProviderStatus:
    """Whether discovery is requested and, as far as the file alone can tell, allowed.

    ``discovery_active`` is the static verdict; a probe still refuses when the
    host's addresses fail the check at probe time.
    """

    id: str
    discovery_requested: bool
    discovery_active: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where ``GET {baseUrl}/capacity`` goes (R-P2): parsed once, pinned per address."""

    scheme: str  # "http" or "https"
    host: str  # lower case, IPv6 without brackets; also the TLS server name
    port: int
    path: str  # base path + "/capacity", exactly one slash between
    host_header: str  # the Host header: host[:port] as written in baseUrl

    @property
    def url(self) -> str:
        """``{baseUrl}/capacity`` as configured (for messages; never carries a key)."""
        return f"{self.scheme}://{self.host_header}{self.path}"

    def url_for(self, address: str) -> str:
        """The URL that connects to ``address`` (a resolved, checked IP) itself."""
        literal = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{literal}:{self.port}{self.path}"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    source: str  # the path read, for messages
    max_concurrent: int | None  # the gateway-wide fallback (R-C2)
    providers: tuple[ProviderConfig, ...]
    statuses: Mapping[str, ProviderStatus]  # by provider id, one per provider
    skipped: tuple[str, ...]  # entries that have no usable id, with the reason
    share: CapacityShare | None = None  # share mode (docs/share.md); None: local mode

    def provider(self, provider_id: str) -> ProviderConfig | None:
        for p in self.providers:
            if p.id == provider_id:
                return p
        return None


def parse_base_url(base_url: str) -> Endpoint:
    """The capacity endpoint of ``baseUrl``; ``ValueError`` says what is wrong with it."""
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in base_url):
        raise ValueError("baseUrl contains whitespace or control characters")
    try:
        parts = urlsplit(base_url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"baseUrl is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("baseUrl must start with http:// or https://")
    if "@" in parts.netloc:
        raise ValueError("baseUrl must not contain user info (the key goes in credentialFile)")
    if "?" in base_url or "#" in base_url:
        raise ValueError("baseUrl must not have a query or fragment")
    host = parts.hostname
    if not host:
        raise ValueError("baseUrl has no host")
    if not host.isascii():
        raise ValueError("baseUrl host must be ASCII (write an international name in punycode)")
    if parse_ip(host) is None and not all(ch.isalnum() or ch in "-._" for ch in host):
        raise ValueError(f"baseUrl host {host!r} is not a host name or IP address")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    if port == 0:
        raise ValueError("baseUrl port 0 is not usable")
    return Endpoint(
        scheme=parts.scheme,
        host=host,
        port=port,
        path=parts.path.rstrip("/") + "/capacity",
        host_header=parts.netloc,
    )


def check_provider(provider: ProviderConfig) -> ProviderStatus:
    """The static verdict for a well-typed entry (no I/O)."""

    def refused(kind: str, why: str) -> ProviderStatus:
        return ProviderStatus(provider.id, True, False, f"{kind}:{why}")

    if not provider.capacity_discovery:
        return ProviderStatus(provider.id, False, False, "not_requested")
    if provider.base_url is None:
        return refused("config_invalid", "baseUrl is required for capacityDiscovery")
    try:
        endpoint = parse_base_url(provider.base_url)
    except ValueError as exc:
        return refused("config_invalid", str(exc))
    if provider.credential_file is None:
        return refused("config_invalid", "credentialFile is required for capacityDiscovery")
    problem = check_credential_spec(provider.credential_file)
    if problem is not None:
        return refused("config_invalid", problem)
    if not provider.models:
        return refused(
            "config_invalid", "models is empty: no upstream model id to match capacity rows"
        )
    problem = static_opt_in(endpoint.host, provider.tailnet)
    if problem is not None:
        return refused("opt_in_refused", problem)
    loopback = _is_loopback_host(endpoint.host)
    if provider.listener_owner is not None and not loopback:
        return refused("config_invalid", LISTENER_OWNER_LOOPBACK_ONLY)
    if loopback:
        return ProviderStatus(provider.id, True, True, "opt_in_ok:loopback")
    if provider.tailnet_check == RANGE_ONLY:
        return ProviderStatus(provider.id, True, True, "opt_in_ok:tailnet-range-only")
    return ProviderStatus(provider.id, True, True, "opt_in_ok:tailnet")


LISTENER_OWNER_LOOPBACK_ONLY: Final = (
    "listenerOwner applies to a loopback baseUrl only (a remote listener's owner cannot be checked)"
)


def _is_loopback_host(host: str) -> bool:
    ip = parse_ip(host)
    return is_localhost_name(host) or (ip is not None and classify(ip) == "loopback")


def provider_problems(entry: Mapping[str, Any]) -> tuple[ProviderConfig, list[str]]:
    """Every static reason a provider entry cannot have discovery, not just the first,
    and the entry made of its well-typed fields (a wrong-typed ``tailnet`` counts as
    absent, with its problem listed).

    :func:`check_provider` stops at the first problem (the sidecar publishes one
    reason); ``check-config`` shows them all, so one edit fixes an entry. Each item
    has the ``config_invalid:``/``opt_in_refused:`` form of :class:`ProviderStatus`.
    """
    problems: list[str] = []
    usable: dict[str, Any] = {"id": entry.get("id")}
    bad: set[str] = set()
    for name, value in entry.items():
        if name == "id" or name not in ENTRY_FIELDS:
            continue
        try:
            msgspec.convert({"id": usable["id"], name: value}, ProviderConfig, strict=True)
        except msgspec.ValidationError as exc:
            problems.append(f"config_invalid:{field_message(str(exc))}")
            bad.add(name)
        else:
            usable[name] = value
    try:
        provider = msgspec.convert(usable, ProviderConfig, strict=True)
    except msgspec.ValidationError as exc:  # fields fine alone, not together (classes)
        problems.append(f"config_invalid:{field_message(str(exc))}")
        usable.pop("defaultClass", None)
        provider = msgspec.convert(usable, ProviderConfig, strict=True)
    if entry.get("capacityDiscovery") is not True:
        return provider, problems

    def missing(field: str, why: str) -> None:
        if field not in bad:  # a wrong type is already reported above
            problems.append(f"config_invalid:{why}")

    endpoint = None
    if provider.base_url is None:
        missing("baseUrl", "baseUrl is required for capacityDiscovery")
    else:
        try:
            endpoint = parse_base_url(provider.base_url)
        except ValueError as exc:
            problems.append(f"config_invalid:{exc}")
    if provider.credential_file is None:
        missing("credentialFile", "credentialFile is required for capacityDiscovery")
    else:
        problem = check_credential_spec(provider.credential_file)
        if problem is not None:
            problems.append(f"config_invalid:{problem}")
    if not provider.models:
        missing("models", "models is empty: no upstream model id to match capacity rows")
    if endpoint is not None and "tailnet" not in bad:
        problem = static_opt_in(endpoint.host, provider.tailnet)
        if problem is not None:
            problems.append(f"opt_in_refused:{problem}")
    if (
        endpoint is not None
        and provider.listener_owner is not None
        and not _is_loopback_host(endpoint.host)
    ):
        problems.append(f"config_invalid:{LISTENER_OWNER_LOOPBACK_ONLY}")
    if "tailnet" in bad:
        problems.append("opt_in_refused:tailnet must be true or false to decide the opt-in")
    return provider, problems


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read and judge the gateway's config file (read-only; R-C1, R-C3)."""
    return judge(read_config_file(path))


def raw_provider_entries(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The provider entries as written, by id (first wins); ``{}`` when unreadable.

    For ``check-config``, which reports every problem of an entry.
    """
    try:
        with open(os.fspath(path), "rb") as f:
            doc = msgspec.json.decode(f.read().removeprefix(UTF8_BOM))
    except (OSError, msgspec.DecodeError):
        return {}
    entries = doc.get("providers") if isinstance(doc, dict) else None
    found: dict[str, dict[str, Any]] = {}
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            found.setdefault(entry["id"], entry)
    return found


def parse_config(data: bytes, source: str = "<config>") -> GatewayConfig:
    """The file typed by ``gateway_config``, then each provider judged (R-C3)."""
    return judge(parse_config_file(data, source))


def judge(file: ConfigFile) -> GatewayConfig:
    statuses: dict[str, ProviderStatus] = {}
    for provider in file.providers:
        problem = file.invalid.get(provider.id)
        if problem is None:
            statuses[provider.id] = check_provider(provider)
        else:
            statuses[provider.id] = ProviderStatus(
                provider.id,
                problem.discovery_requested,
                False,
                f"config_invalid:{problem.reason}",
            )
    share = _share(file.capacity_share, file.source)
    return GatewayConfig(
        file.source, file.max_concurrent, file.providers, statuses, file.skipped, share
    )


def _share(value: Any, source: str) -> CapacityShare | None:
    """``capacityShare``, judged as a whole: a share mode asked for and unusable stops the
    config (exit 2) rather than falling back to local mode, which would over-admit."""
    if value is None:
        return None
    try:
        share = msgspec.convert(value, CapacityShare, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config {source}: capacityShare: {field_message(str(exc))}") from None
    problem = check_share(share)
    if problem is not None:
        raise ConfigError(f"config {source}: capacityShare: {problem}")
    return share
