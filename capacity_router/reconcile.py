"""Reconciling a worker's stated token pool with what it does, as one pure rule.

A server states how many tokens its running requests may hold together (its
``max_running_tokens``, R-K7). If it preempts (vLLM's
``vllm:num_preemptions_total`` rises) it could not hold what it was given: its
real pool is smaller than the stated one now (fragmentation, a prefix cache it
will not evict, a speculative or multimodal reserve). The router then reports
less than stated, so the gateways admit less, and gives it back step by step
once the preemptions stop:

- a poll whose preemption counter rose lowers the reported pool by a quarter
  of what it reports now, never below a quarter of the stated pool;
- after ``CALM_POLLS`` polls in a row without a new preemption it rises by a
  tenth of the stated pool, at most to the stated pool, and the calm count
  starts again;
- a counter that fell (the server restarted) or a stated pool that changed
  starts over at the stated pool;
- a poll that did not read the counter (its ``/metrics`` failed this round: the
  poller carries the stated pool then) learns nothing and gives nothing back: the
  reported pool stays as it was;
- a server that does not count preemptions (llama.cpp holds a request in its
  own slot or refuses it; TGI and SGLang queue instead) is reported as it states.

The router cannot see what the gateways admitted: a preemption lowers the
budget whatever load caused it. With gateways admitting in tokens the load
stays within the reported pool, so a preemption means the stated pool was too
large; with gateways admitting on slots alone, a lower token budget changes
nothing they do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

CALM_POLLS: Final = 10  # polls without a preemption before one step back up
LOWER_BY: Final = 0.25  # of what is reported, per poll that preempted
FLOOR: Final = 0.25  # of the stated pool: never reported below it
RAISE_BY: Final = 0.10  # of the stated pool, per step back up


@dataclass(frozen=True, slots=True)
class Reconciled:
    """One worker's pool as the router reports it, and what it rests on."""

    stated: int  # what the server says its pool holds
    reported: int  # what the router reports (<= stated)
    preemptions: float | None  # the counter as last read
    calm: int = 0  # polls in a row without a new preemption, while lowered
    reason: str = ""  # why ``reported`` is below ``stated`` (empty when it is not)


def reconcile(
    previous: Reconciled | None, stated: int | None, preemptions: float | None
) -> Reconciled | None:
    """This poll's :class:`Reconciled` for a worker, from the last one and what the
    worker states and counts now; None when it states no pool."""
    if stated is None or stated <= 0:
        return None
    if previous is not None and previous.stated == stated and preemptions is None:
        return previous  # not read this poll: nothing learned, nothing given back
    if (
        previous is None
        or previous.stated != stated
        or preemptions is None
        or previous.preemptions is None
        or preemptions < previous.preemptions
    ):
        return Reconciled(stated, stated, preemptions)
    new = preemptions - previous.preemptions
    floor = max(1, int(stated * FLOOR))
    if new > 0:
        reported = max(floor, previous.reported - max(1, int(previous.reported * LOWER_BY)))
        reason = (
            f"lowered to {reported} of the {stated} stated: {new:g} preemption"
            f"{'' if new == 1 else 's'} in the last poll"
        )
        return Reconciled(stated, reported, preemptions, 0, reason)
    if previous.reported >= stated:
        return Reconciled(stated, stated, preemptions)
    calm = previous.calm + 1
    if calm < CALM_POLLS:
        reason = (
            f"lowered to {previous.reported} of the {stated} stated: no preemption "
            f"for {calm} poll{'' if calm == 1 else 's'}, back up after {CALM_POLLS}"
        )
        return Reconciled(stated, previous.reported, preemptions, calm, reason)
    reported = min(stated, previous.reported + max(1, int(stated * RAISE_BY)))
    if reported >= stated:
        return Reconciled(stated, stated, preemptions)
    reason = f"recovering: {reported} of the {stated} stated, no preemption for {calm} polls"
    return Reconciled(stated, reported, preemptions, 0, reason)
