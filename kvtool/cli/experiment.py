"""``kvtool experiment list / run``: the published tiering experiments, re-run at laptop
scale, kvtool's figure beside the published one (docs/experiments.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from kvtool.cli.output import emit, json_option, note, progress

EPILOG_LIST = """
\b
Examples:
  kvtool experiment list
  kvtool experiment list --json
"""

EPILOG_RUN = """
\b
Examples:
  kvtool experiment run gp7000-cliff --simulate
  kvtool experiment run gp7000-cliff --simulate --out out/exp --json
  kvtool experiment run gp7000-read-path
  kvtool experiment run fx100-parallel-read --out out/exp
  kvtool experiment run fixtures/experiments/wqs-random-prompts.toml --simulate

\b
Writes NAME.json (schema kvtool.experiment/1), NAME.csv (the side-by-side table),
NAME-rounds.csv (every configuration's rounds), NAME.png and trace.jsonl into --out.
"""


EPILOG_GROUP = """
\b
Examples:
  kvtool experiment list
  kvtool experiment run gp7000-cliff --simulate
  kvtool experiment fit fx100-serving --vary input_lengths=16000:128000 --max-evals 9
"""

EPILOG_FIT = """
\b
Examples:
  kvtool experiment fit fx100-serving --vary input_lengths=16000:128000 \\
      --vary output_tokens=256:4096 --max-evals 9
  kvtool experiment fit fx100-serving-cold-read --vary input_lengths=2048:16384 --json

\b
Searches the named workload keys (prompt length, share of reused prompts, output length,
...) for the setting under which the model reproduces every published figure of the
experiment at once; prints the best fit, each claim's residual, and whether any setting
meets them all (docs/experiments.md, "Fitting an unpublished workload").
"""


@click.group("experiment", epilog=EPILOG_GROUP)
def command() -> None:
    """Re-run the published tiering experiments (GP7000, FX100, WQS) at laptop scale.

    The *-serving-* experiments run the published performance claims (throughput, TTFT,
    TPOT) on the serving model (kvtool.serving), always simulated."""


@command.command("list", short_help="List the experiments in fixtures/experiments/",
                 epilog=EPILOG_LIST)
@json_option
def list_cmd() -> None:
    """List the experiments in fixtures/experiments/."""
    from kvtool.experiments import list_experiments
    from kvtool.experiments.spec import list_document

    exps = list_experiments()
    doc = list_document(exps)

    def human(con: Any) -> None:
        from kvtool.cli.output import Column, print_table

        print_table(con, [Column("name", justify="left"),
                          Column("source", justify="left", wrap=True, rank=1),
                          Column("claim", justify="left", wrap=True)],
                    [[e.name, e.source, e.claim] for e in exps],
                    title="experiments (kvtool experiment run NAME)", more="--json has them")

    emit(doc, human)


@command.command("run", short_help="Run one experiment and print its side-by-side table",
                 epilog=EPILOG_RUN)
@click.argument("name")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for JSON, CSV, PNG and the trace [default: out/experiments/NAME].")
@click.option("--simulate", is_flag=True,
              help="Replay metadata only (the replayer: no bytes move) instead of data mode.")
@click.option("--dram", "dram", metavar="mooncake://HOST:PORT", default=None,
              help="Data mode: put every configuration's DRAM tier on this Mooncake pool "
                   "(kvtool pool up; kvtool pool status --json gives the URL).")
@click.option("--nvme", "nvme", metavar="PLACE", default=None,
              help="Data mode: the NVMe tiers' place (nvme+tcp://…, a file, a block device) "
                   "[default: the running kvtool target, else a store file].")
@click.option("--scratch", type=click.Path(file_okay=False), default=None,
              help="Directory on a real filesystem (O_DIRECT) for parallel-read targets "
                   "[default: --out].")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT while running.")
@click.option("--seeds", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Generated workloads: run with N seeds and report each figure as the mean "
                   "with a 95% bootstrap confidence interval.")
@json_option
def run_cmd(name: str, out_dir: str | None, simulate: bool, dram: str | None,
            nvme: str | None, scratch: str | None, metrics_port: int | None,
            seeds: int) -> None:
    """Run one experiment (every configuration) and print the side-by-side table."""
    from kvtool.experiments import find_experiment, run_experiment

    exp = find_experiment(name)
    out = Path(out_dir) if out_dir else Path("out") / "experiments" / exp.name
    observer = None
    if metrics_port is not None:
        from kvtool.metrics import serve_metrics

        observer = serve_metrics(metrics_port)
        note(f"metrics on http://127.0.0.1:{observer.port}/metrics")
    note(f"[bold]{exp.name}[/]: {exp.title} · writing into {out}")
    if exp.kind == "parallel-read" and (simulate or dram or nvme):
        note(f"{exp.name} measures reads on its own targets: --simulate, --dram and --nvme "
             "do not apply")
    if exp.kind == "engine-vs-model" and (simulate or dram or nvme):
        note(f"{exp.name} runs a real engine on its own small tiers: --simulate, --dram and "
             "--nvme do not apply")
    if exp.is_serving and (not simulate or dram or nvme):
        note(f"{exp.name} runs on the serving model (simulated, times modelled): --dram and "
             "--nvme do not apply and --simulate is implied")
    if dram is not None:
        from kvtool.mooncake import parse_mooncake_url

        parse_mooncake_url(dram, field="--dram")
    doc = run_experiment(exp, out_dir=out, simulate=simulate, progress=progress,
                         observer=observer, scratch=Path(scratch) if scratch else None,
                         dram=dram, nvme=nvme, on_event=lambda line: note(f"[dim]{line}[/]"),
                         seeds=seeds)
    emit(doc, lambda con: render(con, doc))


@command.command("fit", short_help="Infer an experiment's unpublished workload from its claims",
                 epilog=EPILOG_FIT)
@click.argument("name")
@click.option("--vary", "varies", multiple=True, metavar="KEY=LO:HI", required=True,
              help="A workload key to search over [LO, HI] (repeatable).")
@click.option("--grid", type=click.IntRange(1, 9), default=3, show_default=True,
              help="Grid points per key before the local search.")
@click.option("--max-evals", type=click.IntRange(1, 10000), default=40, show_default=True,
              help="Runs of the experiment in all.")
@click.option("--tolerance", type=float, default=0.25, show_default=True,
              help="A claim is met within this factor (0.25: 1.25×), or inside its band.")
@click.option("--loads", default=None, metavar="LOAD=V1,...",
              help="Search at these loads only (the --sweep syntax); rows at others are left "
                   "out [default: the experiment's].")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON document (kvtool.experiment-fit/1) here.")
@json_option
def fit_cmd(name: str, varies: tuple[str, ...], grid: int, max_evals: int, tolerance: float,
            loads: str | None, out_file: str | None) -> None:
    """Search an experiment's unpublished workload keys for the setting that puts every
    published figure closest, and say whether any setting meets them all."""
    from kvtool.errors import UsageError
    from kvtool.experiments import find_experiment
    from kvtool.experiments.fit import fit, parse_vary

    exp = find_experiment(name)
    parsed = [parse_vary(v, exp) for v in varies]
    if not tolerance > 0:
        raise UsageError(f"must be positive, got {tolerance}", field="tolerance")
    note(f"[bold]{exp.name}[/]: fitting {', '.join(v.key for v in parsed)} "
         f"(up to {max_evals} runs)")
    with progress(f"{exp.name}: fit (runs)", float(max_evals)) as advance:
        doc = fit(exp, parsed, grid=grid, max_evals=max_evals, tolerance=tolerance,
                  loads=loads, on_point=lambda _n, _p: advance(1))
    if out_file:
        from kvtool.jsondoc import dump_json

        try:
            Path(out_file).write_text(dump_json(doc) + "\n", encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {out_file}: {exc.strerror or exc}",
                             field="out") from None
    emit(doc, lambda con: render_fit(con, doc))


def render_fit(con: Any, doc: dict[str, Any]) -> None:
    from kvtool.cli.output import Column, print_table

    con.print(f"[bold]{doc['name']}[/] — best fit of {doc['evaluations']} runs "
              f"(loss {doc['loss']:.4f}, mean squared log residual)")
    best = ", ".join(f"{k} = {v:,.4g}" if isinstance(v, float) else f"{k} = {v:,}"
                     for k, v in doc["best"].items())
    con.print("[dim]searched:[/] " + "; ".join(
        f"{v['key']} {v['lo']:g}–{v['hi']:g} ({v['scale']})" for v in doc["vary"]))
    con.print(f"[dim]best:[/] {best}")

    def pct(r: float | None) -> str:
        if r is None:
            return "–"
        if not math.isfinite(r):
            return "n/a"
        return f"{100 * (math.exp(r) - 1):+.0f} %"

    def alone(r: dict[str, Any]) -> str:
        b = r["best_alone"]
        return pct(b["residual"]) if b else "–"

    print_table(con, [Column("claim", justify="left", wrap=True),
                      Column("published", wrap=True), Column("kvtool", wrap=True),
                      Column("residual"), Column("met", justify="left"),
                      Column("best\nalone", rank=2)],
                [[r["claim"], r["published_text"], r["kvtool_text"], pct(r["residual"]),
                  {True: "yes", False: "[red]no[/]", None: "–"}[r["met"]], alone(r)]
                 for r in doc["rows"]],
                title="claims at the best fit (residual: kvtool / published − 1)",
                more="--json has them")
    colour = "green" if doc["meets_all"] else "yellow"
    con.print(f"[{colour}]{doc['verdict']}[/]")


def render(con: Any, doc: dict[str, Any]) -> None:
    from kvtool.cli.output import Column, print_table

    if doc.get("engine_vs_model") is not None:
        render_engine(con, doc)
        return

    con.print(f"[bold]{doc['name']}[/] — {doc['title']}")
    con.print(f"[dim]source:[/] {doc['source']}")
    con.print(f"[dim]claim:[/] {doc['claim']}")
    scale = doc["scale"]
    if doc["mode"] != "data":  # a data-mode-only clause says nothing about this run
        scale = "; ".join(p for p in scale.split("; ") if not p.startswith("data mode"))
    con.print(f"[dim]scale:[/] {scale}")
    serving = any(c.get("schema") == "kvtool.serving/1" for c in doc.get("configs") or [])
    mode = {"simulate": ("the serving model (counts simulated, times and throughputs "
                         "modelled)" if serving else
                         "simulate (the replayer: counts exact, no bytes moved)"),
            "data": "data (real bytes through every tier)",
            "measure": "measured on this machine"}.get(doc["mode"], doc["mode"])
    con.print(f"[dim]mode:[/] {mode}")
    sd = doc.get("seeds")
    title = "published vs kvtool" + (
        f" (kvtool: mean [95 % CI] over seeds {sd['seeds'][0]}–{sd['seeds'][-1]})" if sd else "")
    agree = {True: "yes", False: "[red]no[/]", None: "–"}
    print_table(con, [Column("claim", justify="left", wrap=True), Column("published", wrap=True),
                      Column("kvtool", wrap=True), Column("unit", justify="left", rank=1),
                      Column("basis", justify="left", rank=2),
                      Column("agrees", justify="left", rank=3)],
                [[r["claim"], r["published_text"], r["kvtool_text"], r["unit"],
                  ("[green]" if r["measured"] else "[yellow]") + r["basis"] + "[/]",
                  agree[r.get("agrees")]]
                 for r in doc["rows"]],
                title=title, more="--json has them")
    notes = [(r["claim"], r["differs"]) for r in doc["rows"] if r["differs"]]
    for claim, why in notes:
        con.print(f"[dim]• {claim}:[/] {why}")
    if doc["notes"]:
        con.print(f"[dim]{doc['notes']}[/]")
    if doc.get("files"):
        con.print("[dim]files:[/] " + " ".join(doc["files"].values()))


def render_engine(con: Any, doc: dict[str, Any]) -> None:
    """An engine-vs-model run: measured against modelled per run and metric."""
    from kvtool.cli.output import Column, print_table

    sec = doc["engine_vs_model"]
    con.print(f"[bold]{doc['name']}[/] — {doc['title']}")
    con.print(f"[dim]scale:[/] {doc['scale']}")
    scalars = ", ".join(f"{k} {v:.4g}" for k, v in sec["scalars"].items())
    from kvtool.experiments.engine_model import METRIC_LABELS

    to = ", ".join(METRIC_LABELS.get(m, (m,))[0] for m in sec["fit_metrics"])
    con.print(f"[dim]fit:[/] {', '.join(sec['fit_scalars'])} to the {to} of "
              f"{_short(sec['fit'])} (kvtool calibrate): {scalars}")
    fit = sec["fit"]
    rows: list[list[str] | None] = []
    for r in doc["rows"]:
        run = r["args"]["run"]
        rows.append([_short(run) + (" (fit)" if run == fit else ""),
                     r["claim"].split(": ", 1)[1],
                     _fig(r["published"]), _fig(r["kvtool"]), f"{r['error_pct']:+.1f}%",
                     r["unit"]])
    print_table(con, [Column("run", justify="left", wrap=True),
                      Column("metric", justify="left"), Column("measured"),
                      Column(f"modelled\n(fit: {_short(fit)})"), Column("error"),
                      Column("unit", justify="left", rank=1)],
                rows, title="vLLM CPU engine (measured) vs serving model (modelled)",
                more="--json has them")
    m = sec["mape_pct"]["predicted"]
    parts = [f"{METRIC_LABELS.get(k, (k,))[0]} {v:.1f}%" for k, v in m.items()
             if v is not None]
    if parts:
        con.print("[dim]mean |error| of the predicted runs:[/] " + ", ".join(parts))
    if doc["notes"]:
        con.print(f"[dim]{doc['notes']}[/]")
    if doc.get("files"):
        con.print("[dim]files:[/] " + " ".join(doc["files"].values()))


def _short(run: str) -> str:
    """``random@concurrency=4`` → ``random c4``; ``random@request-rate=2`` → ``random r2``."""
    trace, _, load = run.partition("@")
    kind, _, value = load.partition("=")
    return f"{trace} {'c' if kind.startswith('concurrency') else 'r'}{value}"


def _fig(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
