"""``gateway-capacity check-config``: would discovery be active for each provider, and why not.

Reads the gateway's config (read-only), then for every provider that asks for
discovery does what a probe does before it sends anything: the static opt-in,
one resolution of the host with every address checked (loopback, Tailscale
ranges, tailscaled whois where it answers), and a read of the key file. Nothing
is sent to any provider and the key is never shown. Exit 2 with one line when
the file cannot be read or parsed, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from gateway_capacity.common import fail
from sidecar.addresses import ResolveError, check_provider_addresses
from sidecar.config import (
    ConfigError,
    GatewayConfig,
    ProviderConfig,
    fallback_limit,
    load_config,
    parse_base_url,
)
from sidecar.credential import CredentialError, read_credential

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
    parser.add_argument("--config", metavar="PATH", required=True, help="the gateway's JSON config")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--tailscale-socket",
        metavar="PATH",
        help="tailscaled LocalAPI socket for the peer check (default: "
        "$GATEWAY_CAPACITY_TAILSCALE_SOCKET or the platform's tailscaled socket)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        fail(str(exc), code=2)
    report = asyncio.run(_check(config, args.tailscale_socket))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_render(report))
    return 0


async def _check(config: GatewayConfig, socket_path: str | None) -> dict[str, Any]:
    providers = await asyncio.gather(
        *(_check_provider(config, p, socket_path) for p in config.providers)
    )
    return {
        "config": config.source,
        "max_concurrent": config.max_concurrent,
        "providers": list(providers),
        "skipped": list(config.skipped),
    }


async def _check_provider(
    config: GatewayConfig, provider: ProviderConfig, socket_path: str | None
) -> dict[str, Any]:
    status = config.statuses[provider.id]
    limit, source = fallback_limit(provider, config)
    entry: dict[str, Any] = {
        "id": provider.id,
        "discovery_requested": status.discovery_requested,
        "discovery_active": False,
        "reason": status.reason,
        "fallback_limit": limit,
        "fallback_source": source,
        "endpoint": None,
        "addresses": [],
        "credential": None,
    }
    if not status.discovery_active:
        return entry
    assert provider.base_url is not None and provider.credential_file is not None
    endpoint = parse_base_url(provider.base_url)
    entry["endpoint"] = endpoint.url
    try:
        async with asyncio.timeout(CHECK_DEADLINE_S):
            check = await check_provider_addresses(
                endpoint.host, endpoint.port, provider.tailnet, socket_path
            )
    except TimeoutError:
        entry["reason"] = (
            f"timeout:resolving and checking {endpoint.host} took over {CHECK_DEADLINE_S:g} s"
        )
        return entry
    except ResolveError as exc:
        entry["reason"] = f"unreachable:{exc}"
        return entry
    entry["addresses"] = [
        {"address": v.address, "allowed": v.allowed, "detail": v.detail} for v in check.verdicts
    ]
    if check.refused is not None:
        entry["reason"] = f"address_refused:{check.refused}"
        return entry
    try:
        read_credential(provider.credential_file)
    except CredentialError as exc:
        entry["credential"] = str(exc)
        entry["reason"] = f"credential_error:{exc}"
        return entry
    entry["credential"] = "ok"
    entry["discovery_active"] = True
    notes = sorted({v.detail for v in check.verdicts if v.detail.startswith("range-checked")})
    if notes:
        entry["reason"] = f"{status.reason}, {'; '.join(notes)}"
    return entry


def _render(report: dict[str, Any]) -> str:
    gateway = report["max_concurrent"]
    lines = [
        f"config {report['config']}: gateway maxConcurrent "
        f"{gateway if gateway is not None else 'not set'}"
    ]
    for p in report["providers"]:
        if p["discovery_active"]:
            state = "discovery would be ACTIVE"
        elif p["discovery_requested"]:
            state = "discovery REFUSED, static limit"
        else:
            state = "static limit (discovery not requested)"
        lines.append(
            f"{p['id']}: {state}; fallback {p['fallback_limit']} from {p['fallback_source']}"
        )
        if p["reason"] != "not_requested":
            lines.append(f"  reason: {p['reason']}")
        if p["endpoint"]:
            lines.append(f"  endpoint: {p['endpoint']}")
        for a in p["addresses"]:
            verdict = "allowed" if a["allowed"] else "REFUSED"
            lines.append(f"  address {a['address']}: {verdict}: {a['detail']}")
        if p["credential"] == "ok":
            lines.append("  credential: readable, well-formed (not shown)")
    for why in report["skipped"]:
        lines.append(f"skipped {why}")
    if not report["providers"] and not report["skipped"]:
        lines.append("no providers configured")
    return "\n".join(lines)
