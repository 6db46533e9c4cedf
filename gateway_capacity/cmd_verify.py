"""``gateway-capacity verify``: probe now, apply the rules, compare with the segment.

Exit 0 when every provider's effective limit in the segment is what the
rules give for a probe made now; 1 when any differs, or a configured upstream
model is missing from a complete answer (a typo in ``models`` holds the limit
at 0); 2 when it could not compare (a provider with discovery got no valid
answer: router down, 404, timeout...; "ok" would be a guess) or for a config
error; 3 when there is no segment. The key is read by the probe and never shown.
A router whose answer changes between the sidecar's last refresh and this
probe shows as a difference: run it again.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gateway_capacity.common import (
    EXIT_NO_SEGMENT,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    add_target_options,
    fail,
    segment_from_args,
)


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
    from sidecar.limits import OPT_IN_REFUSED, decide, previous_from_view, rules_from_config
    from sidecar.probe import probe_providers

    if not args.config:
        fail("verify needs --config PATH (the rules come from the config)", EXIT_USAGE)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    name = segment_from_args(args)
    try:
        view = read_view(name)
    except SegmentMissing as exc:
        fail(str(exc), EXIT_NO_SEGMENT)
    except SegmentError as exc:
        fail(str(exc), EXIT_USAGE)

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
        previous = None if seen is None else previous_from_view(seen)
        probe = probes.get(r.provider_id)
        decision = decide(r, probe, previous, now, legacy_draining=draining)
        segment_limit = None if seen is None else seen.effective_limit
        same = segment_limit == min(decision.effective_limit, _room())
        answered = any(v.ok for v in decision.replicas)
        refused_opt_in = probe is not None and (probe.refused or "").startswith(OPT_IN_REFUSED)
        if r.discovery_active and not refused_opt_in and not answered:
            status = "no_answer"
        elif not same:
            status = "differs"
        elif decision.missing_models:
            status = "missing_models"
        else:
            status = "ok"
        agree = agree and same
        rows.append(
            {
                "id": r.provider_id,
                "agree": same,
                "status": status,
                "missing_models": list(decision.missing_models),
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
    statuses = {row["status"] for row in rows}
    if statuses & {"differs", "missing_models"}:
        code = EXIT_PROBLEM
    elif "no_answer" in statuses:
        code = EXIT_USAGE
    else:
        code = EXIT_OK
    if args.json:
        print(
            json.dumps(
                {"segment": name, "agree": agree, "ok": code == 0, "providers": rows}, indent=2
            )
        )
    else:
        for row in rows:
            print(
                f"{_MARKS[row['status']]} {row['id']}: rules {row['rules_limit']} "
                f"({row['rules_source']}), segment {row['segment_limit']} "
                f"({row['segment_source']}): {row['rules_reason']}"
            )
            if row["status"] == "missing_models":
                print(
                    f"    the router does not report {', '.join(row['missing_models'])}: "
                    "check the provider's models in the config (the limit stays 0)"
                )
            elif row["status"] == "no_answer":
                print("    no valid answer from any replica: could not compare")
            for rep in row["replicas"]:
                print(f"    replica {rep['address']}: {rep['reason']} value {rep['value']}")
    return code


_MARKS = {
    "ok": "ok ",
    "differs": "DIFFERS",
    "missing_models": "MISSING MODEL",
    "no_answer": "NO ANSWER",
}


def _room() -> int:
    from shm_layout.layout import RUNNING_ROOM

    return RUNNING_ROOM
