"""``kvtool calibrate``: fit the serving model's roofline scalars to ``vllm bench serve``
result files (a thin shell over :mod:`kvtool.serving.calibrate`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvtool.cli.output import emit, json_option, progress
from kvtool.errors import UsageError

if TYPE_CHECKING:
    from rich.console import Console

EPILOG = """
\b
Examples:
  kvtool calibrate fixtures/clusters/a100-llama2.toml \\
      fixtures/vllm-bench/a100-llama2-c1.json \\
      fixtures/vllm-bench/a100-llama2-c4.json \\
      fixtures/vllm-bench/a100-llama2-c16.json --fit mfu_prefill,eta,c0_s
  kvtool calibrate fixtures/clusters/a100-llama2.toml \\
      fixtures/vllm-bench/a100-llama2-c1.json \\
      fixtures/vllm-bench/a100-llama2-c16.json --fit mfu_prefill,eta \\
      --scalar c0_s=0.002 --metric median_ttft_ms --metric output_throughput \\
      --folds 0 --json
\b
Result files: what `vllm bench serve --save-result` writes (--save-detailed
adds per-request lengths and send times). The fixtures above were written by
kvtool's own model at known scalars (kvtool_basis = "simulated").
"""


def _split(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


@click.command("calibrate", epilog=EPILOG)
@click.argument("cluster", type=click.Path(dir_okay=False))
@click.argument("results", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--fit", default=None, callback=_split, metavar="S1,S2,...",
              help="Scalars to fit [default: mfu_prefill,mfu_decode,eta,c0_s].")
@click.option("--metric", "metrics", multiple=True, metavar="NAME",
              help="vLLM metric to match (repeatable) [default: mean_ttft_ms, mean_tpot_ms, "
                   "output_throughput].")
@click.option("--scalar", "scalars", multiple=True, metavar="NAME=VALUE",
              help="Hold a roofline scalar at this value (repeatable).")
@click.option("--folds", type=int, default=None,
              help="Held-out check: k-fold with k folds, 0 for none "
                   "[default: leave-one-out].")
@click.option("--block-tokens", type=int, default=16, show_default=True,
              help="Tokens per KV block of the replayed workloads (vLLM's block size).")
@click.option("--max-evals", type=click.IntRange(1), default=500, show_default=True,
              help="Model evaluations per fit (each replays every file of the fit).")
@json_option
def command(cluster: str, results: tuple[str, ...], fit: list[str] | None,
            metrics: tuple[str, ...], scalars: tuple[str, ...], folds: int | None,
            block_tokens: int, max_evals: int) -> None:
    """Fit the serving model's scalars (MFU, eta, c0) to vllm bench serve results.

    Each RESULT file is one `vllm bench serve --save-result` run: its load (max
    concurrency, request rate) and its requests' lengths become a workload the model
    replays on CLUSTER (random prompts, no shared prefix). Nelder-Mead searches the
    scalars that minimise the error of the model's metrics against the files', then each
    file is predicted by a fit to the others (leave-one-out; --folds k for k-fold) and
    the held-out MAPE is reported per metric. Prints the --scalar flags that make
    `kvtool replay --cluster` use the fit. Method: docs/serving.md, "Calibration".
    """
    from kvtool.serving.calibrate import (
        DEFAULT_METRICS,
        FIT_SCALARS,
        CalibrationSettings,
        calibrate,
        parse_scalar_overrides,
    )

    if block_tokens <= 0:
        raise UsageError(f"must be positive, got {block_tokens}", field="block_tokens")
    settings = CalibrationSettings(
        cluster=cluster, results=results, fit=tuple(fit) if fit is not None else FIT_SCALARS,
        metrics=metrics or DEFAULT_METRICS, folds=folds, block_tokens=block_tokens,
        fixed=parse_scalar_overrides(scalars), max_evals=max_evals)
    with progress("calibrating", None, unit="evaluations") as advance:
        doc = calibrate(settings, progress=advance)
    emit(doc, lambda con: render(con, doc))


_SHORT = {"mean_ttft_ms": "TTFT mean", "median_ttft_ms": "TTFT p50", "p90_ttft_ms": "TTFT p90",
          "p99_ttft_ms": "TTFT p99", "mean_tpot_ms": "TPOT mean", "median_tpot_ms": "TPOT p50",
          "p90_tpot_ms": "TPOT p90", "p99_tpot_ms": "TPOT p99", "mean_itl_ms": "ITL mean",
          "median_itl_ms": "ITL p50", "p90_itl_ms": "ITL p90", "p99_itl_ms": "ITL p99",
          "mean_e2el_ms": "E2EL mean", "median_e2el_ms": "E2EL p50", "p90_e2el_ms": "E2EL p90",
          "p99_e2el_ms": "E2EL p99", "output_throughput": "out tok/s",
          "total_token_throughput": "tok/s", "request_throughput": "req/s",
          "duration": "duration"}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}%"


def _num(x: float) -> str:
    return f"{x:.4g}"


def render(con: Console, doc: dict[str, Any]) -> None:
    from rich.table import Table

    files = doc["files"]
    bases = ", ".join(doc["basis"]["measured"])
    con.print(f"[bold]kvtool calibrate[/] {Path(doc['cluster']).name} · {len(files)} runs "
              f"({bases}) · held-out: {doc['held_out']['method']}")
    ft = Table(title="runs", title_justify="left")
    for col in ("run", "load", "reqs", "in/out"):
        ft.add_column(col, justify="left" if col in ("run", "load") else "right",
                      overflow="fold")
    for f in files:
        ft.add_row(Path(f["source"]).name, f["arrivals"], str(f["requests"]),
                   f"{f['mean_input']:.0f}/{f['mean_output']:.0f}")
    con.print(ft)
    st = Table(title="scalars (fitted)", title_justify="left")
    for col in ("scalar", "start", "fitted", "±10% moves", "pinned"):
        st.add_column(col, justify="left" if col == "scalar" else "right")
    for n, v in doc["scalars"].items():
        sens = doc["sensitivity"][n]
        st.add_row(n, _num(doc["start"][n]), _num(v), f"{sens['max_change_pct']:.2f}%",
                   "yes" if sens["identified"] else "[yellow]no[/]")
    con.print(st)
    if doc["fixed"]:
        con.print("held: " + ", ".join(f"{k} = {_num(v)}" for k, v in doc["fixed"].items()))
    mt = Table(title="MAPE (model vs files)", title_justify="left")
    for col in ("metric", "in-sample", "held-out"):
        mt.add_column(col, justify="left" if col == "metric" else "right")
    held = doc["held_out"]["mape_pct"] or {}
    for m in (*doc["metrics"], "all"):
        mt.add_row(_SHORT.get(m, m), _pct(doc["in_sample"]["mape_pct"].get(m)), _pct(held.get(m)))
    con.print(mt)
    opt = doc["optimiser"]
    con.print(f"{opt['evaluations']} evaluations × {opt['runs_per_evaluation']} runs; loss "
              f"{opt['value']:.3g}")
    weak = [n for n, s in doc["sensitivity"].items() if not s["identified"]]
    if weak:
        con.print(f"[yellow]{', '.join(weak)}: a ±10% change moves no metric by 1% on these "
                  "runs, so they do not pin it down; hold it with --scalar or add runs that "
                  "load it.[/]")
    con.print("Use the fit: kvtool replay TRACE --cluster FILE " + " ".join(doc["replay_flags"]))
    con.print("[dim]Scalars fitted; model figures simulated; file figures as the files "
              "label them.[/]")
