"""``gateway-capacity check-config``: would discovery be active for each provider, and why not.

Reads the gateway's config (read-only), then for every provider that asks for
discovery does what a probe does before it sends anything: the static opt-in,
one resolution of the host with every address checked (loopback, Tailscale
ranges, tailscaled whois where it answers), and a read of the key file. Every
problem of a provider is reported, not only the first, so one edit can fix them
all. Nothing is sent to any provider and the key is never shown. It also names
the segment the config's users will share, and what that name derives from, the
keys of ours that look like typos (``sidecar.config.unknown_keys``), and share mode:
on or off, whether redis-py imports, whether its credential file is readable.

``--probe`` then sends what the sidecar would: one ``GET {baseUrl}/capacity`` per
address of each provider that asks for discovery, with the real key and under every
rule of the probe (``sidecar.probe``: pinned addresses, redirects refused, one 3 s
deadline, the key never shown), and says what to do about what it got. It is the
check to run before the sidecar starts; ``verify`` compares with a running one.

Exit 2 with one line when the file cannot be read or parsed; with ``--strict``,
1 when a provider that asks for discovery cannot have it, an entry is skipped, a
key looks like a typo, a provider's classes are refused or share mode cannot
start; with ``--probe``, 1 when a provider that asks for discovery got no valid
answer, or one that leaves its limit at 0 (a model of its ``models`` that no
answer reports); else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from gateway_capacity.common import add_target_options, fail
from gateway_capacity.exits import EXIT_NO_SEGMENT, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from gateway_capacity.schemas import SCHEMA_VERSION
from shm_layout.errors import BadSegmentName
from shm_layout.names import ENV_VAR, check_segment_name, resolve_segment_name
from sidecar.addresses import ResolveError, check_provider_addresses
from sidecar.config import (
    RANGE_ONLY,
    ConfigError,
    GatewayConfig,
    ProviderConfig,
    load_config,
    parse_base_url,
    provider_problems,
    raw_provider_entries,
    redis_url_for_logs,
)
from sidecar.credential import CredentialError, read_credential
from sidecar.limits import fallback_for

if TYPE_CHECKING:
    from sidecar.replica import ProviderProbe

CHECK_DEADLINE_S = 3.0  # the probe's own deadline for resolution and checks (R-P5)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check-config",
        help="per provider: would capacity discovery be active, and why not",
        description=(
            "Check the gateway config: per provider, whether capacity discovery would be "
            "active and why not. Resolves hosts and checks addresses and key files; sends "
            "nothing to any provider and never shows a key."
        ),
    )
    add_target_options(
        parser,
        segment_help="without --config: check the config this segment was made for (as "
        "availability shows it)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a provider that asks for discovery cannot have it, an entry is "
        "skipped, a key of ours looks like a typo, a provider's classes are refused, or share "
        "mode cannot start",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="also probe each provider that asks for discovery now, as the sidecar would "
        "(GET {baseUrl}/capacity with its key, never shown; 3 s deadline); exit 1 when one "
        "gets no valid answer or one that leaves its limit at 0. Run it before starting the "
        "sidecar",
    )
    parser.add_argument(
        "--tailscale-socket",
        metavar="PATH",
        help="tailscaled LocalAPI socket for the peer check (default: "
        "$GATEWAY_CAPACITY_TAILSCALE_SOCKET or the platform's tailscaled socket)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = args.config or _config_of_segment(args.segment)
    try:
        config = load_config(path)
    except ConfigError as exc:
        fail(str(exc), code=EXIT_USAGE)
    entries = raw_provider_entries(path)
    report = asyncio.run(_check(config, entries, args.tailscale_socket))
    report = {"schema_version": SCHEMA_VERSION, **report}
    if args.segment:
        report["segment"], report["segment_from"] = args.segment, "--segment"
    else:
        report["segment"], report["segment_from"] = _segment(path)
    report["unknown_keys"] = [
        {"where": u.where, "key": u.key, "suggestion": u.suggestion} for u in config.unknown_keys
    ]
    report["share"] = share_check(config)
    if args.probe:
        asyncio.run(_probe(config, report, args.tailscale_socket))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_render(report))
    if args.probe and any(
        p["probe"] is not None and (not p["probe"]["ok"] or p["probe"]["missing_models"])
        for p in report["providers"]
    ):
        return EXIT_PROBLEM
    if args.strict and (
        report["skipped"]
        or report["unknown_keys"]
        or report["share"]["problems"]
        or any(p["class_problems"] for p in report["providers"])
        or any(p["discovery_requested"] and not p["discovery_active"] for p in report["providers"])
    ):
        return EXIT_PROBLEM
    return EXIT_OK


def share_check(config: GatewayConfig) -> dict[str, Any]:
    """Share mode as the sidecar would start it, nothing sent to Redis."""
    share = config.share
    redis_py = _redis_py()
    doc: dict[str, Any] = {
        "on": share is not None,
        "redis": None,
        "sentinel": None,
        "listener_owner": None,
        "gateway": None,
        "redis_py": redis_py,
        "credential": None,
        "problems": [],
    }
    if share is None:
        return doc
    doc["redis"] = None if share.redis is None else redis_url_for_logs(share.redis)
    if share.sentinel is not None:
        doc["sentinel"] = {
            "master": share.sentinel.master,
            "addresses": list(share.sentinel.addresses),
        }
    doc["listener_owner"] = share.listener_owner
    doc["gateway"] = share.gateway
    if not redis_py.startswith("importable"):
        doc["problems"].append(f"redis-py {redis_py}")
    if share.credential_file is not None:
        try:
            read_credential(share.credential_file)
        except CredentialError as exc:
            doc["credential"] = str(exc)
            doc["problems"].append(f"capacityShare.credentialFile: {exc}")
        else:
            doc["credential"] = "ok"
    if share.sentinel is not None and share.sentinel.credential_file is not None:
        try:
            read_credential(share.sentinel.credential_file)
        except CredentialError as exc:
            doc["problems"].append(f"capacityShare.sentinel.credentialFile: {exc}")
    return doc


def _redis_py() -> str:
    """Whether the share mode's Redis client imports, said as check-config shows it."""
    try:
        import redis
    except ImportError as exc:
        return (
            f"not importable ({type(exc).__name__}: {exc}): pip install 'gateway-capacity[share]'"
        )
    return f"importable ({getattr(redis, '__version__', 'version unknown')})"


async def _probe(config: GatewayConfig, report: dict[str, Any], socket_path: str | None) -> None:
    """Probe every provider that asks for discovery, as the sidecar would (R-P1..R-P8)."""
    from sidecar.probe import probe_providers

    asked = [p for p in config.providers if config.statuses[p.id].discovery_requested]
    probes = await probe_providers(asked, tailscale_socket=socket_path)
    for entry in report["providers"]:
        probe = probes.get(entry["id"])
        provider = config.provider(entry["id"])
        if probe is None or provider is None:
            continue
        answered = [r for r in probe.replicas if r.ok]
        reported = {m for r in answered for m in r.models}
        missing = sorted(provider.upstream_models - reported) if answered else []
        entry["probe"] = {
            "ok": bool(answered),
            "refused": probe.refused,
            "replicas": [
                {
                    "address": r.address,
                    "ok": r.ok,
                    "reason": r.reason,
                    "detail": r.detail,
                    "complete": r.complete,
                    "models": dict(r.models),
                    "request_tokens": dict(r.request_tokens),
                    "running_tokens": dict(r.running_tokens),
                }
                for r in probe.replicas
            ],
            "missing_models": missing,
            "hints": probe_hints(provider, probe, missing),
        }


def probe_hints(provider: ProviderConfig, probe: ProviderProbe, missing: list[str]) -> list[str]:
    """What to do about what a probe got, one line each (pure)."""
    hints: list[str] = []
    url = parse_base_url(provider.base_url).url if provider.base_url else "{baseUrl}/capacity"
    base_path = urlsplit(provider.base_url or "").path.rstrip("/")
    reasons = {r.reason for r in probe.replicas}
    if probe.refused is not None:
        kind = probe.refused.partition(":")[0]
        hint = {
            "unreachable": "the host did not resolve: check the host name in baseUrl",
            "timeout": "resolving the host took over 3 s: check DNS on this host",
        }.get(kind)
        if hint is not None:  # every other refusal says its fix itself
            hints.append(hint)
    if "no_endpoint" in reasons:
        if not base_path.endswith("/v1"):
            hints.append(
                f"{url} answered 404 and baseUrl {provider.base_url} does not end with /v1: "
                "check the /v1 suffix (the capacity router answers {baseUrl}/capacity with "
                "baseUrl http://HOST:PORT/v1)"
            )
        else:
            hints.append(
                f"{url} answered 404: is baseUrl the capacity router's ('gateway-capacity "
                "router serve')? A worker or another gateway has no /v1/capacity"
            )
    if "auth_failed" in reasons:
        hints.append(
            f"the router refused the key: credentialFile ({provider.credential_file}) must "
            "hold the key the router was started with (router serve --key-file)"
        )
    if "unreachable" in reasons:
        hints.append(
            f"nothing answered at {url}: start the router, or correct the host and port in baseUrl"
        )
    if "timeout" in reasons:
        hints.append(f"no whole answer from {url} within 3 s: is the router overloaded?")
    if "redirect_refused" in reasons:
        hints.append("redirects are refused (R-P4): point baseUrl at the final address")
    if reasons & {"stale", "future"}:
        hints.append(
            "the answer's observed_at is too old or ahead of this host's clock: check both "
            "clocks (NTP) and that the router polls its workers"
        )
    if reasons & {"invalid", "too_large", "http_error"}:
        hints.append(f"{url} did not give a capacity answer: is baseUrl the capacity router's?")
    if missing:
        hints.append(
            f"models names {', '.join(missing)}, which the router does not report: the limit "
            "would stay 0; name in models only what the farm serves"
        )
    return hints


def _config_of_segment(segment: str | None) -> str:
    """The config path a sidecar recorded in ``segment``, or exit 2 saying what to give."""
    from shm_layout.errors import SegmentError, SegmentMissing
    from shm_layout.view import read_view

    if not segment:
        fail("give --config PATH (or --segment NAME of a segment a sidecar wrote)", EXIT_USAGE)
    try:
        recorded = read_view(check_segment_name(segment)).config_path
    except BadSegmentName as exc:
        fail(str(exc), code=EXIT_USAGE)
    except SegmentMissing as exc:
        fail(str(exc), code=EXIT_NO_SEGMENT)
    except SegmentError as exc:
        fail(str(exc), code=EXIT_USAGE)
    if not recorded:
        fail(f"segment {segment} names no config (no sidecar has written it)", EXIT_USAGE)
    return recorded


def _segment(config_path: str) -> tuple[str | None, str]:
    """The segment the sidecar and handlers will use, and what the name comes from."""
    try:
        name = resolve_segment_name(None, config_path)
    except BadSegmentName as exc:
        return None, f"${ENV_VAR} is unusable: {exc}"
    if os.environ.get(ENV_VAR):
        return name, f"${ENV_VAR}"
    return name, f"the config path {os.path.abspath(config_path)}"


async def _check(
    config: GatewayConfig, entries: dict[str, dict[str, Any]], socket_path: str | None
) -> dict[str, Any]:
    providers = await asyncio.gather(
        *(_check_provider(config, p, entries.get(p.id, {}), socket_path) for p in config.providers)
    )
    return {
        "config": config.source,
        "max_concurrent": config.max_concurrent,
        "providers": list(providers),
        "skipped": list(config.skipped),
    }


async def _check_provider(
    config: GatewayConfig,
    provider: ProviderConfig,
    raw: dict[str, Any],
    socket_path: str | None,
) -> dict[str, Any]:
    from sidecar.probe import listener_refusal  # httpx: only when a config is checked

    status = config.statuses[provider.id]
    limit, source = fallback_for(provider.max_concurrent, config.max_concurrent)
    default = provider.default_class_index
    classes = [
        {
            "name": c.name,
            "reserve": c.reserve,
            "cap": c.cap,
            "max_wait": c.max_wait,
            "default": index == default,
        }
        for index, c in enumerate(provider.classes)
    ]
    if raw:
        provider, problems = provider_problems(raw)
    else:
        problems = []
    if status.discovery_requested and not status.discovery_active and not problems:
        problems = [status.reason]  # the raw entry changed under us: the loader's word
    entry: dict[str, Any] = {
        "id": provider.id,
        "discovery_requested": status.discovery_requested,
        "discovery_active": False,
        "reason": status.reason,
        "problems": problems,
        "fallback_limit": limit,
        "fallback_source": source,
        "fallback_share": False,
        "endpoint": None,
        "addresses": [],
        "credential": None,
        "probe": None,
        "classes": classes,
        "class_problems": list(config.class_problems.get(provider.id, ())),
    }
    if not status.discovery_requested:
        return entry
    # The address and key checks run whenever they can, even after a static problem,
    # so that every problem is reported at once.
    try:
        endpoint = parse_base_url(provider.base_url) if provider.base_url else None
    except ValueError:
        endpoint = None
    if endpoint is not None and not any(p.startswith("opt_in_refused:") for p in problems):
        entry["endpoint"] = endpoint.url
        await _check_addresses(
            entry,
            endpoint.host,
            endpoint.port,
            tailnet=provider.tailnet,
            socket_path=socket_path,
            range_only=provider.tailnet_check == RANGE_ONLY,
        )
        allowed = [a["address"] for a in entry["addresses"] if a["allowed"]]
        refusal = listener_refusal(provider, endpoint.port, allowed)
        if refusal is not None:
            problems.append(f"listener_refused:{refusal}")
    if provider.credential_file is not None and not any("credentialFile" in p for p in problems):
        try:
            read_credential(provider.credential_file)
        except CredentialError as exc:
            entry["credential"] = str(exc)
            problems.append(f"credential_error:{exc}")
        else:
            entry["credential"] = "ok"
    if problems:
        entry["reason"] = problems[0]
        return entry
    entry["discovery_active"] = True
    if config.share is not None:
        # share mode's rule, not a maxConcurrent: no share in force admits 0 (docs/share.md)
        entry.update(fallback_limit=0, fallback_source="default", fallback_share=True)
    notes = sorted(
        {a["detail"] for a in entry["addresses"] if a["detail"].startswith("range-checked")}
    )
    if notes:
        entry["reason"] = f"{status.reason}, {'; '.join(notes)}"
    return entry


async def _check_addresses(
    entry: dict[str, Any],
    host: str,
    port: int,
    *,
    tailnet: bool,
    socket_path: str | None,
    range_only: bool,
) -> None:
    problems: list[str] = entry["problems"]
    try:
        async with asyncio.timeout(CHECK_DEADLINE_S):
            check = await check_provider_addresses(
                host, port, tailnet=tailnet, socket_path=socket_path, range_only=range_only
            )
    except TimeoutError:
        problems.append(f"timeout:resolving and checking {host} took over {CHECK_DEADLINE_S:g} s")
        return
    except ResolveError as exc:
        problems.append(f"unreachable:{exc}")
        return
    entry["addresses"] = [
        {"address": v.address, "allowed": v.allowed, "detail": v.detail} for v in check.verdicts
    ]
    if check.refused is not None:
        problems.append(f"address_refused:{check.refused}")


def _render(report: dict[str, Any]) -> str:
    gateway = report["max_concurrent"]
    lines = [
        f"config {report['config']}: gateway maxConcurrent "
        f"{gateway if gateway is not None else 'not set'}",
        f"segment {report['segment'] or '(none)'} (from {report['segment_from']})",
    ]
    for u in report["unknown_keys"]:
        hint = f"; did you mean {u['suggestion']}?" if u["suggestion"] else ""
        lines.append(f"unknown key {u['key']!r} in {u['where']}{hint} (ignored)")
    for p in report["providers"]:
        if p["discovery_active"]:
            state = "discovery would be ACTIVE"
        elif p["discovery_requested"]:
            state = "discovery REFUSED, static limit"
        else:
            state = "static limit (discovery not requested)"
        source = "share mode" if p["fallback_share"] else f"from {p['fallback_source']}"
        lines.append(f"{p['id']}: {state}; fallback {p['fallback_limit']} {source}")
        if len(p["problems"]) > 1:
            lines.extend(f"  problem: {why}" for why in p["problems"])
        elif p["reason"] != "not_requested":
            lines.append(f"  reason: {p['reason']}")
        if p["endpoint"]:
            lines.append(f"  endpoint: {p['endpoint']}")
        for a in p["addresses"]:
            verdict = "allowed" if a["allowed"] else "REFUSED"
            lines.append(f"  address {a['address']}: {verdict}: {a['detail']}")
        if p["credential"] == "ok":
            lines.append("  credential: readable, well-formed (not shown)")
        lines.extend(_render_classes(p))
        if p["probe"] is not None:
            said = p["probe"]["refused"] in (p["reason"], *p["problems"])
            lines.extend(_render_probe(p["probe"], said=said))
    for why in report["skipped"]:
        lines.append(f"skipped {why}")
    if not report["providers"] and not report["skipped"]:
        lines.append("no providers configured")
    lines.extend(_render_share(report["share"]))
    return "\n".join(lines)


def _render_classes(p: dict[str, Any]) -> list[str]:
    if p["class_problems"]:
        return [
            "  classes: REFUSED, it admits as one queue (no reserve, no cap) until fixed:",
            *(f"    problem: {why}" for why in p["class_problems"]),
        ]
    if not p["classes"]:
        return []
    said = []
    for c in p["classes"]:
        parts = ["default"] if c["default"] else []
        parts.append(f"reserve {c['reserve']}")
        parts.append(f"cap {c['cap']}" if c["cap"] is not None else "no cap")
        if c["max_wait"] is not None:
            parts.append(f"maxWait {c['max_wait']:g} s")
        said.append(f"{c['name']} ({', '.join(parts)})")
    return [f"  classes, highest first: {'; '.join(said)}"]


def _render_share(share: dict[str, Any]) -> list[str]:
    if not share["on"]:  # redis-py matters only to share mode: no advice to install it
        if share["redis_py"].startswith("importable"):
            return [f"share mode: off (no capacityShare); redis-py {share['redis_py']}"]
        return ["share mode: off (no capacityShare)"]
    sentinel = share.get("sentinel")
    where = (
        f"Redis {share['redis']}"
        if sentinel is None
        else f"the master {sentinel['master']!r} of the Sentinel set "
        f"{', '.join(sentinel['addresses'])} (a failover rebuilds each table)"
    )
    lines = [f"share mode: ON, gateway {share['gateway']!r}, {where}"]
    lines.append(f"  redis-py: {share['redis_py']}")
    if share["credential"] == "ok":
        lines.append("  credential: readable, well-formed (not shown)")
    elif share["credential"] is None:
        lines.append("  credential: none (capacityShare.credentialFile not set)")
    owner = share.get("listener_owner")
    lines.append(
        "  a loopback Redis/sentinel must be listened on by "
        + (
            f"listenerOwner {owner!r}"
            if owner is not None
            else "root, this user or a redis/valkey user"
        )
    )
    lines.append(
        "  Redis out of reach for longer than a lease: every gateway holds 0 until it answers"
    )
    lines.extend(f"  problem: {why}" for why in share["problems"])
    return lines


def _tokens_said(replica: dict[str, Any], model: str) -> str:
    """A row's token fields as the probe read them (R-K7), or nothing when it has none."""
    request = replica.get("request_tokens", {}).get(model)
    running = replica.get("running_tokens", {}).get(model)
    if request is None and running is None:
        return ""
    shown = ["?" if n is None else str(n) for n in (request, running)]
    return f" (tokens: {shown[0]} a request, {shown[1]} running)"


def _render_probe(probe: dict[str, Any], *, said: bool) -> list[str]:
    if probe["refused"] is not None:
        why = "for the reason above" if said else probe["refused"]
        lines = [f"  probe: NOT SENT, {why}"]
    elif probe["ok"] and probe["missing_models"]:
        lines = [
            "  probe: NOT OK, answered but the limit would stay 0: no answer reports "
            + ", ".join(probe["missing_models"])
        ]
    elif probe["ok"]:
        lines = ["  probe: ok"]
    else:
        lines = ["  probe: FAILED, no valid answer"]
    for r in probe["replicas"]:
        if r["ok"]:
            models = ", ".join(
                f"{m} {n}{_tokens_said(r, m)}" for m, n in sorted(r["models"].items())
            )
            state = "complete" if r["complete"] else "INCOMPLETE"
            lines.append(f"    replica {r['address']}: ok, {state}: {models or 'no models'}")
        else:
            detail = f": {r['detail']}" if r["detail"] else ""
            lines.append(f"    replica {r['address']}: {r['reason']}{detail}")
    lines.extend(f"    do: {hint}" for hint in probe["hints"])
    return lines
