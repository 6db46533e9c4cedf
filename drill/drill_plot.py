"""The drill's picture: the limit in force, what ran and what waited, by generation, over
time, with the scenario's marks (matplotlib, a PNG; ``make drill`` draws
docs/upgrade-drill.png)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from drill_records import GEN_A, GEN_B

if TYPE_CHECKING:
    from drill_rig import Drill


def plot(drill: Drill, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = drill.samples
    t = [x.t for x in s]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 7), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    colours = {GEN_A: "tab:blue", GEN_B: "tab:green"}
    top.step(t, [x.limit for x in s], where="post", color="black", lw=2.2, label="limit in force")
    top.plot(
        t,
        [x.inflight for x in s],
        color="tab:red",
        lw=1.0,
        label="in flight at the upstream (admitted)",
    )
    top.plot(
        t,
        [x.legacy_inflight for x in s],
        color="tab:gray",
        lw=1.4,
        ls=":",
        label="in flight at the upstream (legacy, not admitted)",
    )
    for gen in (GEN_A, GEN_B):
        top.plot(
            t,
            [x.by_generation.get(gen, 0) for x in s],
            color=colours[gen],
            lw=1.4,
            label=f"running, {gen}",
        )
    top.set_ylabel("running / in flight")
    top.set_ylim(-1, 24)
    bottom.plot(t, [x.waiting for x in s], color="tab:orange", lw=2.0, label="waiting (all)")
    for gen in (GEN_A, GEN_B):
        bottom.plot(
            t,
            [x.waiting_by_generation.get(gen, 0) for x in s],
            color=colours[gen],
            lw=1.0,
            ls="--",
            label=f"waiting, {gen}",
        )
    bottom.axhline(32, color="tab:orange", lw=0.8, ls="-.", label="queue bound (32)")
    bottom.set_ylabel("waiting")
    bottom.set_ylim(-1, 36)
    bottom.set_xlabel("seconds since the drill started")
    for ax in (top, bottom):
        for when, _, tag in drill.marks:
            if tag:
                ax.axvline(when, color="0.7", lw=0.7)
        ax.legend(loc="upper left", fontsize=7, bbox_to_anchor=(1.01, 1.0))
    for when, _, tag in drill.marks:
        if tag:
            top.annotate(
                tag, (when, 23.5), rotation=90, fontsize=7, va="top", ha="right", color="0.3"
            )
    top.set_title("Upgrade drill: one admission budget across legacy, generation A and B")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
