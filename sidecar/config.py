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
  resolves and checks the addresses (``capacity_contract.addresses``);
- ``opt_in_refused:<why>``: the host may not receive the credential (R-P1);
- ``config_invalid:<why>``: a field has the wrong type or value.

Reading and typing the file is ``gateway_config``'s, which the handlers use alone;
its names are re-exported here for the sidecar and the CLI. An entry without a usable
``id`` is listed in :attr:`GatewayConfig.skipped` with the reason.
"""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Annotated, Any, Final, Literal
from urllib.parse import parse_qs, unquote, urlparse, urlsplit

import msgspec

from capacity_contract import shown
from capacity_contract.addresses import classify, is_localhost_name, parse_ip, static_opt_in
from gateway_config import (
    CLASS_KEYS,
    CLASSES_REFUSED,
    ENTRY_FIELDS,
    MAX_LIMIT,
    MAX_PROVIDER_ID_BYTES,
    RANGE_ONLY,
    TOP_LEVEL_FIELDS,
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
from sidecar.credential import check_credential_spec

__all__ = [
    "CLASSES_REFUSED",
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
    "ShareSentinel",
    "TailnetCheck",
    "Uid",
    "UnknownKey",
    "UpstreamModelId",
    "UserName",
    "check_provider",
    "check_share",
    "classes_status",
    "judge",
    "load_config",
    "outage_keeps",
    "parse_base_url",
    "parse_config",
    "provider_problems",
    "raw_provider_entries",
    "redis_url_for_logs",
    "sentinel_addresses",
    "share_outage_rule",
    "share_outage_said",
    "share_target_for_logs",
    "unknown_keys",
]


GatewayId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
LeaseSeconds = Annotated[float, msgspec.Meta(ge=1.0, le=300.0)]
ShareFloor = Annotated[int, msgspec.Meta(ge=0, le=64)]
MostGateways = Annotated[int, msgspec.Meta(ge=1, le=64)]
# below 1: a token pool of P > 0 then always leaves the table a pool of at least 1 (0
# would read as no pool stated, nothing limited)
KeepPart = Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)]


SentinelAddress = Annotated[str, msgspec.Meta(min_length=3, max_length=300)]


class ShareSentinel(msgspec.Struct, kw_only=True, frozen=True, rename="camel"):
    """``capacityShare.sentinel``: a Sentinel set that names the Redis master (redis-py's
    ``redis.asyncio.sentinel.Sentinel``). ``credentialFile`` is the sentinels' own
    password (their ``requirepass``), read under the provider key's rules; the master's
    is ``capacityShare.credentialFile``."""

    master: GatewayId  # the master's name in the sentinels' config
    addresses: Annotated[list[SentinelAddress], msgspec.Meta(min_length=1, max_length=9)]
    credential_file: str | None = None


def sentinel_addresses(sentinel: ShareSentinel) -> list[tuple[str, int]]:
    """The sentinels as (host, port); ``ValueError`` for one that is not ``host:port``."""
    found = []
    for text in sentinel.addresses:
        parts = urlsplit("//" + text)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or port == 0 or parts.netloc != text:
            raise ValueError(f"sentinel address {text!r} is not host:port")
        found.append((parts.hostname, port))
    return found


class CapacityShare(msgspec.Struct, kw_only=True, frozen=True, rename="camel"):
    """``capacityShare``: several gateways share each discovered capacity through Redis
    (docs/share.md). Absent: every gateway admits up to the whole capacity (local mode).

    ``redis`` is a ``redis://`` or ``rediss://`` (TLS) URL without a password, in its
    user part or its query (:data:`REDIS_PLAIN_OPTIONS`); the password, if any, is read
    from ``credentialFile`` under the provider key's rules.
    """

    redis: str | None = None  # one Redis; or the master a Sentinel set names:
    sentinel: ShareSentinel | None = None
    gateway: GatewayId
    credential_file: str | None = None
    lease: LeaseSeconds = 10.0
    floor: ShareFloor = 1
    # who must own the socket listening on a loopback Redis before anything is sent
    # there (the credential, or a call whose answer would be trusted); None: root, the
    # sidecar's user, or a user named redis or valkey (sidecar/share.py)
    listener_owner: Uid | UserName | None = None
    # the outage rule (docs/share.md, "An outage"): at most ``gateways`` gateways share
    # the farm; with ``outage`` "keep" (the default once ``gateways`` is declared) each
    # keeps floor(C * keepPart / gateways) of the capacity C it discovers itself through
    # an outage, and the table shares the rest; "hold": 0 through an outage
    gateways: MostGateways | None = None
    outage: Literal["keep", "hold"] | None = None
    keep_part: KeepPart = 0.5


def outage_keeps(share: CapacityShare) -> bool:
    """Whether each gateway keeps a part of the capacity through an outage."""
    return share.gateways is not None and share.outage != "hold"


def share_outage_rule(share: CapacityShare) -> str:
    """The outage rule this gateway declares to the table (``sidecar.shares.outage_rule``)."""
    from sidecar.shares import outage_rule

    keep = round(share.keep_part * 1000) if outage_keeps(share) else 0
    return outage_rule(share.gateways, keep)


def share_outage_said(share: CapacityShare) -> str:
    """The outage rule in words, as check-config and the start log say it."""
    if outage_keeps(share):
        return (
            f"each gateway keeps floor(C x {share.keep_part:g} / {share.gateways}) of the "
            f"capacity C it discovers, without Redis; the table shares the rest and refuses "
            f"a gateway beyond {share.gateways} live at once"
        )
    if share.gateways is not None:
        return (
            f"every gateway holds 0 until Redis answers (outage: hold); the table refuses "
            f"a gateway beyond {share.gateways} live at once"
        )
    return (
        "every gateway holds 0 until Redis answers (no gateways declared: declare the most "
        "gateways sharing the farm in capacityShare.gateways to keep a part)"
    )


def check_share(share: CapacityShare) -> str | None:
    """``None`` when ``share`` can be used, else why not (no file or network access)."""
    if (share.redis is None) == (share.sentinel is None):
        return "give redis (one Redis URL) or sentinel (a Sentinel set), one of the two"
    if share.outage == "keep" and share.gateways is None:
        return (
            "outage keep needs gateways: the most gateways that share the farm (each keeps "
            "floor(C x keepPart / gateways) through an outage)"
        )
    if share.sentinel is not None:
        return _check_sentinel(share, share.sentinel)
    return _check_redis_url(share, share.redis or "")


def _check_sentinel(share: CapacityShare, sentinel: ShareSentinel) -> str | None:
    try:
        addresses = sentinel_addresses(sentinel)
    except ValueError as exc:
        return f"sentinel: {exc}"
    remote = [f"{h}:{p}" for h, p in addresses if not _is_loopback_host(h)]
    secret = share.credential_file is not None or sentinel.credential_file is not None
    if remote and secret:
        return (
            f"sentinel: {remote[0]} is not on this host and a Sentinel set is reached without "
            "TLS here: a password goes only to sentinels (and a master) on this host"
        )
    if remote and share.listener_owner is not None:
        return "listenerOwner applies to sentinels on this host only"
    for spec in (share.credential_file, sentinel.credential_file):
        if spec is not None:
            problem = check_credential_spec(spec)
            if problem is not None:
                return problem
    try:
        import redis.asyncio.sentinel  # noqa: F401
    except ImportError:
        return "share mode needs the Python package redis (pip install 'gateway-capacity[share]')"
    return None


def _check_redis_url(share: CapacityShare, url: str) -> str | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as exc:
        return f"redis: not a URL ({exc})"
    if parts.scheme not in ("redis", "rediss"):
        return "redis: must be a redis:// or rediss:// URL"
    if not parts.hostname:
        return "redis: the URL names no host"
    names = _redis_query_names(url)
    lone_user = parts.username or "username" in names
    users = [
        unquote(parts.username or ""),
        *parse_qs(urlparse(url).query).get("username", []),
    ]
    if any(":" in user for user in users):  # redis-py sends ``u%3Apw`` as one user name
        return "redis: put no password in the URL; use credentialFile (kept out of argv and logs)"
    if parts.password is not None or (lone_user and not share.credential_file):
        return "redis: put no password in the URL; use credentialFile (kept out of argv and logs)"
    own = sorted(name for name in names if name in REDIS_SIDECAR_OPTIONS)
    if own:
        return (
            f"redis: drop ?{own[0]}= from the URL; the sidecar sets its own Redis "
            "deadlines (the query would override them)"
        )
    unknown = sorted(name for name in names if name not in REDIS_PLAIN_OPTIONS)
    if unknown:
        # named only when it is a name redis-py takes a secret by: a bare ``?hunter2``
        # is itself the secret, and this line goes to the log
        secret = [name for name in unknown if name in ("password", "ssl_password")]
        what = f"?{secret[0]}=" if secret else "a query name that is not a plain option"
        return (
            f"redis: put no password in the URL ({what}; docs/share.md lists the plain "
            "options); use credentialFile (kept out of argv and logs)"
        )
    tls = sorted(name for name in names if name.startswith("ssl_"))
    if tls and parts.scheme != "rediss":
        return f"redis: ?{tls[0]}= needs a rediss:// URL (TLS)"
    from sidecar.share import url_problem

    problem = url_problem(url)
    if problem is not None:
        return f"redis: {shown(problem)}"
    if share.credential_file is not None:
        problem = check_credential_spec(share.credential_file)
        if problem is not None:
            return problem
    if not _is_loopback_host(parts.hostname):
        if share.credential_file is not None and parts.scheme != "rediss":
            return (
                "redis: a password for a Redis that is not on this host goes only over "
                "TLS: use rediss:// (with ?ssl_ca_certs= naming the certificate to pin)"
            )
        if parts.scheme == "rediss" and _tls_unverified(url):
            return "redis: ?ssl_cert_reqs= must verify the certificate of a Redis not on this host"
        if share.listener_owner is not None:
            return (
                "listenerOwner applies to a loopback Redis only (a remote owner cannot be checked)"
            )
    return None


REDIS_SIDECAR_OPTIONS: Final = frozenset(
    {
        "socket_timeout",
        "socket_connect_timeout",
        "retry_on_timeout",
        "retry_on_error",
        "health_check_interval",
        "timeout",
    }
)
"""Query names redis-py would let override the sidecar's own deadlines (refused)."""

REDIS_PLAIN_OPTIONS: Final = frozenset(
    {
        # what redis-py's parse_url reads from a URL's query and types (not secrets) ...
        "db",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_read_size",
        "socket_keepalive",
        "retry_on_timeout",
        "retry_on_error",
        "max_connections",
        "health_check_interval",
        "ssl_check_hostname",
        "ssl_validate_ocsp",
        "ssl_validate_ocsp_stapled",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
        "ssl_min_version",
        "timeout",
        "protocol",
        "legacy_responses",
        # ... and the names it passes on as strings that are paths or names, not secrets
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_cert_reqs",
        "client_name",
        "username",  # a name; the password goes in credentialFile
    }
)
"""Query names a ``capacityShare.redis`` URL may carry. redis-py's ``parse_url`` hands
every query name to the connection as a keyword, so ``?password=``, ``?ssl_password=``
and any name it does not type could carry a secret into a widely read file."""


def _tls_unverified(url: str) -> bool:
    reqs = parse_qs(urlparse(url).query).get("ssl_cert_reqs", [])
    return any(value.strip().lower() == "none" for value in reqs)


def _redis_query_names(url: str) -> set[str]:
    # as redis-py reads it: urlparse (``;params`` split off) then parse_qs, which
    # percent-decodes the names (``?pass%77ord=`` is ``password``)
    return set(parse_qs(urlparse(url).query, keep_blank_values=True))


def share_target_for_logs(share: CapacityShare) -> str:
    """Where share mode's Redis is, for messages: the URL or the Sentinel set."""
    if share.sentinel is not None:
        return (
            f"the master {share.sentinel.master!r} of the Sentinel set "
            f"{', '.join(share.sentinel.addresses)}"
        )
    return redis_url_for_logs(share.redis or "")


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
    _: KW_ONLY
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
    unknown_keys: tuple[UnknownKey, ...] = ()  # keys of ours that are probably typos
    # by provider id: why its classes were refused (it admits as one queue)
    class_problems: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def provider(self, provider_id: str) -> ProviderConfig | None:
        for p in self.providers:
            if p.id == provider_id:
                return p
        return None


def classes_status(config: GatewayConfig) -> str:
    """``ok``, or every provider whose classes were refused with its first problem (the
    segment keeps 128 bytes of it; ``check-config`` lists them all)."""
    if not config.class_problems:
        return "ok"
    said = "; ".join(f"{pid}: {why[0]}" for pid, why in config.class_problems.items())
    return f"{CLASSES_REFUSED}, one queue instead: {said}"


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
        return ProviderStatus(
            provider.id, discovery_requested=True, discovery_active=False, reason=f"{kind}:{why}"
        )

    if not provider.capacity_discovery:
        return ProviderStatus(
            provider.id, discovery_requested=False, discovery_active=False, reason="not_requested"
        )
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
    problem = static_opt_in(endpoint.host, tailnet=provider.tailnet)
    if problem is not None:
        return refused("opt_in_refused", problem)
    loopback = _is_loopback_host(endpoint.host)
    if provider.listener_owner is not None and not loopback:
        return refused("config_invalid", LISTENER_OWNER_LOOPBACK_ONLY)
    if loopback:
        return ProviderStatus(
            provider.id,
            discovery_requested=True,
            discovery_active=True,
            reason="opt_in_ok:loopback",
        )
    if provider.tailnet_check == RANGE_ONLY:
        return ProviderStatus(
            provider.id,
            discovery_requested=True,
            discovery_active=True,
            reason="opt_in_ok:tailnet-range-only",
        )
    return ProviderStatus(
        provider.id, discovery_requested=True, discovery_active=True, reason="opt_in_ok:tailnet"
    )


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
        if name == "id" or name not in ENTRY_FIELDS or name in CLASS_KEYS:
            continue  # the classes' problems are their own (gateway_config.class_problems)
        try:
            msgspec.convert({"id": usable["id"], name: value}, ProviderConfig, strict=True)
        except msgspec.ValidationError as exc:
            problems.append(f"config_invalid:{field_message(str(exc))}")
            bad.add(name)
        else:
            usable[name] = value
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
        problem = static_opt_in(endpoint.host, tailnet=provider.tailnet)
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
                discovery_requested=problem.discovery_requested,
                discovery_active=False,
                reason=f"config_invalid:{problem.reason}",
            )
    share = _share(file.capacity_share, file.source)
    return GatewayConfig(
        file.source,
        file.max_concurrent,
        file.providers,
        statuses,
        file.skipped,
        share,
        tuple(unknown_keys(file.document)),
        file.class_problems,
    )


def _share(value: Any, source: str) -> CapacityShare | None:
    """``capacityShare``, judged as a whole: a share mode asked for and unusable stops the
    config (exit 2) rather than falling back to local mode, which would over-admit."""
    if value is None:
        return None
    try:
        share = msgspec.convert(value, CapacityShare, strict=True)
    except msgspec.ValidationError as exc:
        typos = "".join(f"; {u}" for u in _own_object(value, CapacityShare, "capacityShare"))
        raise ConfigError(
            f"config {source}: capacityShare: {field_message(str(exc))}{typos}"
        ) from None
    problem = check_share(share)
    if problem is not None:
        raise ConfigError(f"config {source}: capacityShare: {problem}")
    return share


# --- unknown keys ------------------------------------------------------------------------
#
# The file is the gateway's: its top level and each provider entry hold the gateway's own
# keys beside ours (R-C1), so an unknown key there is named only when it is a near miss of
# one of ours (``capacityDiscovry``, ``base_url``, ``CredentialFile``). ``capacityShare``
# and any object nested in a key of ours are the product's own: every unknown key there is
# named. Either way the key is ignored and the sidecar runs; ``check-config`` shows them
# and ``--strict`` fails on them. The known keys are the Structs' own fields, so a field
# added to ``ProviderConfig`` or ``CapacityShare`` is known at once.


@dataclass(frozen=True, slots=True)
class UnknownKey:
    where: str  # "providers[0] (llama-a)", "capacityShare", "the top level"
    key: str
    suggestion: str | None  # the known key it most resembles, if any

    def __str__(self) -> str:
        hint = f"; did you mean {self.suggestion}?" if self.suggestion else ""
        return f"unknown key {self.key!r} in {self.where}{hint} (ignored)"


def _normal(key: str) -> str:
    return key.lower().replace("_", "").replace("-", "")


def _nearest(key: str, known: frozenset[str], cutoff: float) -> str | None:
    by_normal = {_normal(k): k for k in known}
    if _normal(key) in by_normal:
        return by_normal[_normal(key)]
    near = difflib.get_close_matches(_normal(key), list(by_normal), n=1, cutoff=cutoff)
    return by_normal[near[0]] if near else None


@functools.cache
def _struct_fields(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """A Struct's JSON names and, for those whose value is an object of ours, its Struct
    type (``None`` for any other value)."""
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.encode_name: _inner_struct(f.type) for f in info.fields}


def _inner_struct(t: msgspec.inspect.Type) -> type[msgspec.Struct] | None:
    """The Struct of a field whose value is an object of ours, or an array of them."""
    if isinstance(t, msgspec.inspect.StructType):
        return t.cls
    if isinstance(t, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType)):
        return _inner_struct(t.item_type)
    if isinstance(t, msgspec.inspect.Metadata):
        return _inner_struct(t.type)
    if isinstance(t, msgspec.inspect.UnionType):
        found = [_inner_struct(u) for u in t.types]
        return next((f for f in found if f is not None), None)
    return None


def _own_object(value: Any, struct: type[msgspec.Struct], where: str) -> Iterator[UnknownKey]:
    """Every unknown key of an object that is wholly ours (or of each object of an array
    of them, ``classes``), nested objects of ours too."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            yield from _own_object(item, struct, f"{where}[{index}]")
        return
    if not isinstance(value, dict):
        return
    fields = _struct_fields(struct)
    known = frozenset(fields)
    for key, inner in value.items():
        if not isinstance(key, str):
            continue
        if key not in fields:
            yield UnknownKey(where, key, _nearest(key, known, 0.75))
        elif fields[key] is not None:
            yield from _own_object(inner, fields[key], f"{where}.{key}")


def _shared_object(
    value: Any, struct: type[msgspec.Struct] | None, known: frozenset[str], where: str
) -> Iterator[UnknownKey]:
    """The near misses of an object the gateway shares with us; objects of ours in it are
    checked whole."""
    if not isinstance(value, dict):
        return
    fields = _struct_fields(struct) if struct is not None else {}
    for key, inner in value.items():
        if not isinstance(key, str):
            continue
        if key in known:
            if fields.get(key) is not None:
                yield from _own_object(inner, fields[key], f"{where}.{key}")
            continue
        near = (
            _nearest(key, known, 0.8)
            if len(key) >= 6 or _normal(key) in map(_normal, known)
            else None
        )
        if near is not None:
            yield UnknownKey(where, key, near)


def unknown_keys(document: Any) -> list[UnknownKey]:
    """The keys of ``document`` (the decoded config) that are probably typos of ours."""
    if not isinstance(document, dict):
        return []
    found = list(_shared_object(document, None, TOP_LEVEL_FIELDS, "the top level"))
    share = document.get("capacityShare")
    found.extend(_own_object(share, CapacityShare, "capacityShare"))
    entries = document.get("providers")
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        if isinstance(entry, dict):
            name = entry.get("id")
            where = f"providers[{index}]" + (f" ({name})" if isinstance(name, str) else "")
            found.extend(_shared_object(entry, ProviderConfig, ENTRY_FIELDS, where))
    return found
