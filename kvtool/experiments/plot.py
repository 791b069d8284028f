"""The PNG of an experiment (needs the ``plot`` extra; imported only when writing one).

* multi-turn: token hit ratio per round, and **store puts** per round (computed blocks
  written into the store, promotions not counted), one line per configuration;
* random prompts: token hit ratio by prompt length, per round, one line per configuration;
* parallel read: GB/s one chunk at a time vs in parallel, per target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtool.experiments.figures import FigureUnavailable, RunData, put_blocks
from kvtool.experiments.spec import Experiment


def plot_experiment(exp: Experiment, data: RunData, path: Path) -> None:
    from kvtool.plotting import pyplot, save

    plt = pyplot("out")
    title = f"{exp.name}: {exp.title} ({data.mode})"
    if exp.kind == "multi-turn":
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
        _multi_turn(data, ax1, ax2)
    elif exp.kind == "random-prompts":
        fig, ax1 = plt.subplots(1, 1, figsize=(8, 5))
        _random_prompts(data, ax1)
    else:
        fig, ax1 = plt.subplots(1, 1, figsize=(8, 5))
        _parallel(data, ax1)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save(fig, path, field="out")


def _multi_turn(data: RunData, ax1: Any, ax2: Any) -> None:
    bb = data.block_bytes
    for label, res in data.results.items():
        rounds = res["rounds"]
        x = [r["round"] for r in rounds]
        band = data.bands.get(label)
        if band is not None:   # --seeds: the mean over the seeds and its 95 % interval
            bx, mean, lo, hi = band
            line, = ax1.plot(bx, mean, marker=".", label=f"{label} (mean, 95 % CI)")
            ax1.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.25, linewidth=0)
        else:
            ax1.plot(x, [r["token_hit_ratio"] for r in rounds], marker=".", label=label)
        tiers = [t["name"] for t in res["tiers"]]
        try:
            puts = [put_blocks(r, tiers[-1], tiers) for r in rounds]
        except FigureUnavailable:
            continue
        ax2.plot(x, [p * bb / 1e9 if bb else p for p in puts], marker=".", label=label)
        if res.get("cliff_round") is not None:
            ax1.axvline(res["cliff_round"], color="red", alpha=0.3, linewidth=4)
    ax1.set_ylabel("token hit ratio")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_ylabel("store puts, GB per round" if bb else "store puts, blocks per round")
    ax2.set_xlabel("round")
    from matplotlib.ticker import MaxNLocator

    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)


def _random_prompts(data: RunData, ax: Any) -> None:
    for label, reqs in data.requests.items():
        by: dict[tuple[int, int], list[int]] = {}
        for rnd, inp, hit in reqs:
            by.setdefault((rnd, inp), []).append(hit)
        for rnd in sorted({r for r, _ in by}):
            xs = sorted(inp for r, inp in by if r == rnd)
            ax.plot(xs, [sum(by[(rnd, x)]) / (x * len(by[(rnd, x)])) for x in xs], marker="o",
                    label=f"{label}, round {rnd}")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("prompt length, tokens")
    ax.set_ylabel("token hit ratio (" + ("simulated" if data.mode == "simulate"
                                         else "counted on real bytes") + ")")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _parallel(data: RunData, ax: Any) -> None:
    targets = [t for t in data.reads if not t.startswith("_")]
    xs = range(len(targets))
    serial = [data.reads[t]["serial"]["gbps"] for t in targets]
    par = [data.reads[t]["parallel"]["gbps"] for t in targets]
    ax.bar([x - 0.2 for x in xs], serial, width=0.4, label="one chunk at a time")
    ax.bar([x + 0.2 for x in xs], par, width=0.4, label="in parallel")
    ax.set_xticks(list(xs), targets)
    ax.set_ylabel("GB/s (measured)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
