"""``gateway-capacity verify``: probe now, apply the rules, compare with the segment.

Exit 0 when every provider's effective limit in the segment, and its token
budget (R-L10; in share mode within the pool, R-T7), is what the rules give for
a probe made now; 1 when any differs, or a configured upstream
model is missing from a complete answer (a typo in ``models`` holds the limit
at 0); 2 when it could not compare (a provider with discovery got no valid
answer: router down, 404, timeout...; "ok" would be a guess) or for a config
error; 3 when there is no segment. The key is read by the probe and never shown.
With ``--segment`` alone, the rules come from the config the segment was made for.
A router whose answer changes between the sidecar's last refresh and this
probe shows as a difference: run it again.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gateway_capacity.common import add_target_options, fail, segment_from_args
from gateway_capacity.exits import EXIT_NO_SEGMENT, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from gateway_capacity.schemas import SCHEMA_VERSION

if TYPE_CHECKING:
    from shm_layout.view import SegmentView
    from sidecar.limits import ProviderRules
    from sidecar.replica import ProviderProbe


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

    from shm_layout.errors import SegmentError, SegmentMissing
    from shm_layout.view import read_view
    from sidecar.config import ConfigError, load_config
    from sidecar.limits import rules_from_config
    from sidecar.probe import probe_providers

    name = segment_from_args(args)
    try:
        view = read_view(name)
    except SegmentMissing as exc:
        fail(str(exc), EXIT_NO_SEGMENT)
    except SegmentError as exc:
        fail(str(exc), EXIT_USAGE)
    # the rules come from the config: --config, else the one the segment was made for
    config_path = args.config or view.config_path
    if not config_path:
        fail(
            f"segment {name} names no config (no sidecar has written it): give --config PATH",
            EXIT_USAGE,
        )
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)

    rules = rules_from_config(config)
    active = {r.provider_id for r in rules if r.discovery_active}
    opted = [p for p in config.providers if p.id in active]
    probes = asyncio.run(probe_providers(opted, tailscale_socket=args.tailscale_socket))
    rows = compare(rules, probes, view, time.time())
    code = exit_code(rows)
    note = sidecar_note(view)
    if args.json:
        agree = all(row["agree"] for row in rows)
        doc = {
            "schema_version": SCHEMA_VERSION,
            "segment": name,
            "config": config_path,
            "agree": agree,
            "ok": code == EXIT_OK,
            "providers": rows,
            "sidecar": note,
        }
        print(json.dumps(doc, indent=2))
    else:
        if note is not None:
            print(note)
        if rows:
            print(render_text(rows))
    return code


def sidecar_note(view: SegmentView) -> str | None:
    """Why the segment may hold an old limit: no sidecar, or one stopped or stale, and
    since when; ``None`` while one runs and beats."""
    from gateway_capacity.cmd_views import STALE_HEARTBEAT_S
    from gateway_capacity.schemas import sidecar_status

    s = view.sidecar
    if s is None:
        return (
            f"no sidecar has written segment {view.name}: its limits are the handlers' "
            "fallbacks, not a probe's ('gateway-capacity availability --check' says what to do)"
        )
    age = s.heartbeat_age_s
    if s.alive and s.state == "running" and age is not None and age <= STALE_HEARTBEAT_S:
        return None
    state = sidecar_status(s) if not s.alive or s.state != "running" else "is stale"
    beat = "never" if age is None else f"{age:.0f}s ago"
    return (
        f"sidecar pid {s.pid} {state}, last heartbeat {beat}: the segment holds what it "
        "last published, so it can differ from a probe made now ('gateway-capacity "
        "availability --check' says what to do)"
    )


def compare(
    rules: Sequence[ProviderRules],
    probes: Mapping[str, ProviderProbe],
    view: SegmentView,
    now: float,
) -> list[dict[str, Any]]:
    """One row per provider: the rules' limit for ``probes`` at ``now`` beside the segment's.

    Pure: no I/O, no clock. ``status`` is ``ok``, ``differs``, ``missing_models`` or
    ``no_answer`` (discovery is on and no replica gave a valid answer).
    """
    from shm_layout.layout import RUNNING_ROOM
    from sidecar.limits import DISCOVERED, OPT_IN_REFUSED, SHARE, decide, previous_from_view

    draining = view.sidecar is not None and view.sidecar.alive and view.sidecar.legacy_alive > 0
    rows: list[dict[str, Any]] = []
    for r in rules:
        seen = view.provider(r.provider_id)
        previous = None if seen is None else previous_from_view(seen)
        probe = probes.get(r.provider_id)
        decision = decide(r, probe, previous, now, legacy_draining=draining)
        segment_limit = None if seen is None else seen.effective_limit
        same = segment_limit == min(decision.effective_limit, RUNNING_ROOM)
        if seen is not None and seen.source == SHARE and decision.source == DISCOVERED:
            # share mode: the segment enforces this gateway's share of the discovered
            # capacity; what the rules give is that capacity, and the share stays within it
            same = seen.discovered == min(decision.effective_limit, RUNNING_ROOM) and (
                seen.effective_limit <= (seen.discovered or 0)
            )
        # the token budget (R-L10): the segment's is the rules' (in share mode at most
        # the pool, R-T7), and the most one request may hold is the workers' own
        seg_tokens = 0 if seen is None else seen.token_limit or 0
        seg_request = 0 if seen is None else seen.request_token_limit or 0
        if seen is not None and seen.source == SHARE and decision.source == DISCOVERED:
            tokens_same = seg_request == decision.request_token_limit and (
                seg_tokens <= decision.token_limit if decision.token_limit else seg_tokens == 0
            )
        else:
            tokens_same = (seg_tokens, seg_request) == (
                decision.token_limit,
                decision.request_token_limit,
            )
        same = same and tokens_same
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
        rows.append(
            {
                "id": r.provider_id,
                "agree": same,
                "status": status,
                "missing_models": list(decision.missing_models),
                "rules_limit": decision.effective_limit,
                "rules_source": decision.source,
                "rules_reason": decision.reason,
                "rules_token_limit": decision.token_limit,
                "rules_request_token_limit": decision.request_token_limit,
                "segment_limit": segment_limit,
                "segment_source": None if seen is None else seen.source,
                "segment_token_limit": seg_tokens,
                "segment_request_token_limit": seg_request,
                "tokens_agree": tokens_same,
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
    return rows


def exit_code(rows: Sequence[Mapping[str, Any]]) -> int:
    """1 when a limit differs or a model is missing, else 2 when one could not compare."""
    statuses = {row["status"] for row in rows}
    if statuses & {"differs", "missing_models"}:
        return EXIT_PROBLEM
    if "no_answer" in statuses:
        return EXIT_USAGE
    return EXIT_OK


def render_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """The human form of :func:`compare`'s rows, one block per provider."""
    lines = []
    for row in rows:
        lines.append(
            f"{_MARKS[row['status']]} {row['id']}: rules {row['rules_limit']} "
            f"({row['rules_source']}), segment {row['segment_limit']} "
            f"({row['segment_source']}): {' '.join(row['rules_reason'].split())}"
        )
        if row["status"] == "missing_models":
            lines.append(
                f"    the router does not report {', '.join(row['missing_models'])}: "
                "check the provider's models in the config (the limit stays 0)"
            )
        elif row["status"] == "no_answer":
            lines.append("    no valid answer from any replica: could not compare")
        if (
            row.get("rules_token_limit")
            or row.get("rules_request_token_limit")
            or not row.get("tokens_agree", True)
        ):
            lines.append(
                f"    tokens by the rules: {_tokens_text(row, 'rules')}; segment: "
                f"{_tokens_text(row, 'segment')}"
                + ("" if row.get("tokens_agree", True) else " (DIFFERS)")
            )
        for rep in row["replicas"]:
            value = "-" if rep["value"] is None else rep["value"]  # as availability shows it
            lines.append(f"    replica {rep['address']}: {rep['reason']} value {value}")
    return "\n".join(lines)


def _tokens_text(row: Mapping[str, Any], side: str) -> str:
    running = row.get(f"{side}_token_limit") or "no budget"
    request = row.get(f"{side}_request_token_limit") or "unknown"
    return f"{running} running, {request} a request"


_MARKS = {
    "ok": "ok ",
    "differs": "DIFFERS",
    "missing_models": "MISSING MODEL",
    "no_answer": "NO ANSWER",
}
