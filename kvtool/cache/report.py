"""Replay reports as files: per-round CSV and a PNG plot.

Both take the result dictionaries of :func:`kvtool.cache.replay` (one per configuration).
matplotlib is an extra (``pip install 'kvtool[plot]'``) and is imported only here, only
when a plot is asked for, so replay start-up stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtool.cache.tier import TIER_NAMES
from kvtool.errors import UsageError

CSV_COLUMNS = (
    ["config", "round", "requests", "input_tokens", "token_hit_ratio", "hit_tokens"]
    + [f"hit_tokens_{t}" for t in TIER_NAMES]
    + ["recompute_tokens"]
    + [f"blocks_written_{t}" for t in TIER_NAMES]
    + [f"bytes_written_{t}" for t in TIER_NAMES]
    + [f"put_blocks_{t}" for t in TIER_NAMES]
    + [f"promoted_blocks_{t}" for t in TIER_NAMES]
    + [f"bytes_read_{t}" for t in TIER_NAMES]
    + [f"evictions_{t}" for t in TIER_NAMES]
    + ["ttft_p50_s", "ttft_p99_s", "wall_s"]
)
"""Columns of ``--csv``: one row per configuration and round; absent tiers are empty."""


def write_csv(results: list[dict[str, Any]], path: str | Path) -> None:
    """One row per (configuration, round); see :data:`CSV_COLUMNS`."""
    try:
        f = open(path, "w", newline="", encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}", field="csv") from None
    import csv  # here: a replay without --csv need not import it

    with f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for res in results:
            for rnd in res["rounds"]:
                row: dict[str, Any] = {
                    "config": res["label"], "round": rnd["round"], "requests": rnd["requests"],
                    "input_tokens": rnd["input_tokens"],
                    "token_hit_ratio": f"{rnd['token_hit_ratio']:.6f}",
                    "hit_tokens": rnd["hit_tokens"]["total"],
                    "recompute_tokens": rnd["recompute_tokens"],
                    "ttft_p50_s": rnd["ttft_p50_s"], "ttft_p99_s": rnd["ttft_p99_s"],
                    "wall_s": rnd["wall_s"],
                }
                for t in TIER_NAMES:
                    for field in ("hit_tokens", "blocks_written", "bytes_written", "put_blocks",
                                  "promoted_blocks", "bytes_read",
                                  "evictions"):
                        row[f"{field}_{t}"] = rnd[field].get(t)
                w.writerow(["" if row[c] is None else row[c] for c in CSV_COLUMNS])


class RequestCsv:
    """Per-request rows (``--requests-csv``), written as the replay goes.

    Columns: ``config, line, round, input_tokens, hit_tokens, hit_tokens_{tier},
    recompute_tokens, blocks_written_{tier}, evictions_{tier}, ttft_s``.
    """

    COLUMNS = (["config", "line", "round", "input_tokens", "hit_tokens"]
               + [f"hit_tokens_{t}" for t in TIER_NAMES] + ["recompute_tokens"]
               + [f"blocks_written_{t}" for t in TIER_NAMES]
               + [f"evictions_{t}" for t in TIER_NAMES] + ["ttft_s"])

    def __init__(self, path: str | Path, labels: list[str]) -> None:
        try:
            self._file = open(path, "w", newline="", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise UsageError(f"cannot write {path}: {exc.strerror}",
                             field="requests_csv") from None
        self._labels = labels
        import csv

        self._writer = csv.writer(self._file)
        self._writer.writerow(self.COLUMNS)

    def __call__(self, config: int, o: Any) -> None:
        row = [self._labels[config], o.line, o.round, o.input_tokens,
               sum(o.hit_tokens.values())]
        row += [o.hit_tokens.get(t, "") for t in TIER_NAMES] + [o.recompute_tokens]
        row += [o.blocks_written.get(t, "") for t in TIER_NAMES]
        row += [o.evictions.get(t, "") for t in TIER_NAMES] + [f"{o.ttft_s:.6f}"]
        self._writer.writerow(row)

    def close(self) -> None:
        self._file.close()


def write_plot(results: list[dict[str, Any]], path: str | Path, *, title: str = "") -> None:
    """Two panels: token hit ratio per round (per tier, or per configuration when
    comparing), and bytes (or blocks) written per round. Needs the ``plot`` extra."""
    from kvtool.plotting import pyplot, save

    plt = pyplot("plot")

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    kind = results[0].get("round_kind", "round")
    xlabel = "minute of trace" if kind == "window" else "round"
    compare = len(results) > 1
    use_bytes = all(r["block_bytes"] for r in results)
    banded = False
    for res in results:
        rounds = res["rounds"]
        x = [r["round"] for r in rounds]
        tiers = [t["name"] for t in res["tiers"]]
        if compare:
            ax1.plot(x, [r["token_hit_ratio"] for r in rounds], marker=".", label=res["label"])
        else:
            ax1.plot(x, [r["token_hit_ratio"] for r in rounds], marker=".", color="black",
                     label="all tiers")
            for t in tiers:
                ax1.plot(x, [r["hit_ratio_by_tier"][t] for r in rounds], linestyle="--",
                         label=t)
        key = "bytes_written" if use_bytes else "blocks_written"
        scale = 1e9 if use_bytes else 1
        if compare:
            ax2.plot(x, [sum(v or 0 for v in r[key].values()) / scale for r in rounds],
                     marker=".", label=res["label"])
        else:
            for t in tiers:
                ax2.plot(x, [(r[key][t] or 0) / scale for r in rounds], marker=".", label=t)
        cliff = res.get("cliff_round")
        if cliff is not None:
            ax1.axvline(cliff, color="red", alpha=0.3, linewidth=4)
            banded = True
    ax1.set_ylabel("token hit ratio")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    # legends beside the panels, never over a line
    ax1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax2.set_ylabel("GB written per " + xlabel if use_bytes else "blocks written per " + xlabel)
    ax2.set_xlabel(xlabel)
    from matplotlib.ticker import MaxNLocator

    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax1.set_title((title or "kvtool replay") + (" (red band: collapse round)" if banded else ""),
                  fontsize=10)
    fig.tight_layout()
    save(fig, path)


def check_output_paths(**paths: str | None) -> None:
    """Fail before a long replay, not after it: every output's directory must exist."""
    for option, path in paths.items():
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"cannot write {path}: no such directory",
                             field=option)
