"""``gateway-capacity verify``: probe now, apply the rules, compare with the segment.

Exit 0 when every provider's effective limit in the segment is what the
rules give for a probe made now; 1 when any differs; 2 for a config error;
3 when there is no segment. The key is read by the probe and never shown.
A router whose answer changes between the sidecar's last refresh and this
probe shows as a difference: run it again.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gateway_capacity.common import add_target_options, fail, segment_from_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify", help="probe every replica now and compare the rules' limit with the segment's"
    )
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tailscale-socket", metavar="PATH", help="tailscaled LocalAPI socket")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from shm_layout.segment import SegmentError, SegmentMissing
    from shm_layout.view import read_view
    from sidecar.config import ConfigError, load_config
    from sidecar.limits import LimitDecision, decide, rules_from_config
    from sidecar.probe import probe_providers

    if not args.config:
        fail("verify needs --config PATH (the rules come from the config)", 2)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        fail(str(exc), 2)
    name = segment_from_args(args)
    try:
        view = read_view(name)
    except SegmentMissing as exc:
        fail(str(exc), 3)
    except SegmentError as exc:
        fail(str(exc), 2)

    rules = rules_from_config(config)
    opted = [
        p
        for p in config.providers
        if any(r.provider_id == p.id and r.discovery_active for r in rules)
    ]
    probes = asyncio.run(probe_providers(opted, tailscale_socket=args.tailscale_socket))
    now = time.time()
    draining = view.sidecar is not None and view.sidecar.alive and view.sidecar.legacy_alive > 0
    rows: list[dict[str, Any]] = []
    agree = True
    for r in rules:
        seen = view.provider(r.provider_id)
        previous = None
        if seen is not None and seen.discovered is not None:
            previous = LimitDecision(
                provider_id=r.provider_id,
                effective_limit=seen.effective_limit,
                source=seen.source,
                reason=seen.reason,
                discovered=seen.discovered,
                observed_at=seen.observed_at,
                expires_at=seen.expires_at,
                fallback_limit=seen.fallback_limit,
                fallback_source=seen.fallback_source,
            )
        decision = decide(r, probes.get(r.provider_id), previous, now, legacy_draining=draining)
        segment_limit = None if seen is None else seen.effective_limit
        same = segment_limit == min(decision.effective_limit, _room())
        agree = agree and same
        rows.append(
            {
                "id": r.provider_id,
                "agree": same,
                "rules_limit": decision.effective_limit,
                "rules_source": decision.source,
                "rules_reason": decision.reason,
                "segment_limit": segment_limit,
                "segment_source": None if seen is None else seen.source,
                "replicas": [
                    {
                        "address": v.address,
                        "ok": v.ok,
                        "complete": v.complete,
                        "value": v.value,
                        "reason": v.reason,
                        "observed_at": v.observed_at,
                    }
                    for v in decision.replicas
                ],
            }
        )
    if args.json:
        print(json.dumps({"segment": name, "agree": agree, "providers": rows}, indent=2))
    else:
        for row in rows:
            mark = "ok " if row["agree"] else "DIFFERS"
            print(
                f"{mark} {row['id']}: rules {row['rules_limit']} ({row['rules_source']}), "
                f"segment {row['segment_limit']} ({row['segment_source']}): {row['rules_reason']}"
            )
            for rep in row["replicas"]:
                print(f"    replica {rep['address']}: {rep['reason']} value {rep['value']}")
    return 0 if agree else 1


def _room() -> int:
    from shm_layout.layout import RUNNING_ROOM

    return RUNNING_ROOM
