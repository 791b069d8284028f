"""``kvtool bench``: sequential/random object reads and writes, QD sweep, aligned vs bounce."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import click

from kvtool.cli.hostopts import host_options
from kvtool.cli.load import block_tokens_option, parse_lba, resolve_object
from kvtool.cli.options import block_size_options
from kvtool.cli.output import emit, json_option, note, progress, shown_path
from kvtool.errors import CheckFailed, UsageError
from kvtool.units import format_size, parse_size

if TYPE_CHECKING:
    from rich.console import Console

    from kvtool.nvme.hostauth import HostCredentials

PATTERNS = ("seq-write", "rand-write", "seq-read", "rand-read")  # == kvtool.store.bench's
PATHS = ("aligned", "bounce")

EPILOG = """
\b
Example:
  kvtool bench /var/tmp/bench.img --create 2GiB --model deepseek-v4-flash --dtype fp8
  kvtool bench /var/tmp/bench.img --model deepseek-v4-flash --pattern rand-read --need 2.5
  kvtool bench /dev/loop3 --block-bytes 32MiB --qd 1,8,32 --seconds 3 --force
  kvtool bench /dev/nvme1n1 --model llama-3-70b --read-only --pattern rand-read --json
  kvtool bench --cluster fixtures/clusters/gp7000-mini.toml --block-bytes 1MiB --qd 8

With --cluster FILE (a cluster that kvtool cluster up brought up), every client node
(objects: one block of the file's engines unless --model or --block-bytes says)
drives the cluster's NVMe/TCP targets at once, like fio's client/server mode: one Ray
task per node, one run per case (default: rand-read at QD 8); it reports each node's
and the aggregate GB/s and IOPS (measured; docs/cluster.md).

Every case runs --repeat times (the whole list over and over); a row shows the median
run and the range of the runs, and a difference is called only beyond that range.

Write patterns overwrite TARGET from offset 0 (a kvtool store on it is destroyed): they
need a blank target, one an earlier kvtool bench wrote, or --force. --read-only runs
only the read patterns and writes nothing. With an object that is not a whole number of
LBAs, each case runs twice: the object through the bounce buffer, and an aligned object
of the same padded size.
"""


def _csv(text: str, allowed: tuple[str, ...], field: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise UsageError(f"unknown value(s) {', '.join(bad) or repr(text)}; choose from "
                         f"{', '.join(allowed)}", field=field)
    return items


def _qds(text: str) -> list[int]:
    try:
        qds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"expected queue depths like 1,4,16, got {text!r}",
                         field="--qd") from None
    if not qds or min(qds) < 1:
        raise UsageError(f"queue depths must be ≥ 1, got {text!r}", field="--qd")
    return qds


@click.command("bench", epilog=EPILOG)
@click.argument("target", required=False)
@block_size_options
@block_tokens_option
@click.option("--qd", "qd_text", default="1,4,16", show_default=True,
              help="Queue depths to sweep (comma-separated).")
@click.option("--pattern", "pattern_text", default=",".join(PATTERNS), show_default=True,
              help="Patterns (comma-separated).")
@click.option("--path", "path_text", help="aligned, bounce or both (default: both when the "
              "object needs padding, else aligned).")
@click.option("--seconds", type=float, default=1.0, show_default=True,
              help="Duration of each run of a case.")
@click.option("--repeat", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Runs of each case (the spread needs at least 2).")
@click.option("--need", "need_gbps", type=float, default=None, metavar="GB/S",
              help="Verdict per pattern: does its best case reach GB/s in every run? "
                   "(exit 1 when a pattern falls short)")
@click.option("--ops", type=int, help="Stop each case after this many objects.")
@click.option("--region", metavar="SIZE", default="1GiB", show_default=True,
              help="Bytes of the target to exercise (from offset 0).")
@click.option("--read-only", is_flag=True, help="Run the read patterns only; write nothing.")
@click.option("--force", is_flag=True, help="Allow write patterns on a non-blank target.")
@click.option("--lba", metavar="SIZE", help="Logical block size to align to (default: the "
              "target's).")
@click.option("--create", metavar="SIZE", help="Create TARGET as a regular file of this size.")
@click.option("--cluster", "cluster_file", metavar="FILE", help="Drive the targets of the "
              "cluster FILE brought up (kvtool cluster up) from all its client nodes at once.")
@click.option("--clients", type=click.IntRange(1), help="With --cluster: use the first N "
              "client nodes (default: all).")
@host_options
@json_option
def command(target: str | None, model: str | None, dtype: str | None, tp: int | None,
            block_bytes: int | None, block_tokens: int, qd_text: str, pattern_text: str,
            path_text: str | None,
            seconds: float, repeat: int, need_gbps: float | None, ops: int | None, region: str,
            read_only: bool, force: bool,
            lba: str | None, create: str | None, cluster_file: str | None,
            clients: int | None, credentials: HostCredentials | None) -> None:
    """Measure GB/s, IOPS and latency (p50/p99/p99.9) of object-sized I/O on TARGET
    (or, with --cluster, from every node of a cluster at once)."""
    from kvtool.store.bench import bench

    if cluster_file is not None:
        if target is not None:
            raise UsageError("give TARGET or --cluster, not both", field="--cluster")
        ctx = click.get_current_context()
        _bench_cluster(cluster_file, model, dtype, tp, block_bytes, block_tokens,
                       qd_text if _given(ctx, "qd_text") else "8",
                       pattern_text if _given(ctx, "pattern_text") else "rand-read",
                       seconds if _given(ctx, "seconds") else 3.0, clients,
                       region if _given(ctx, "region") else None, force)
        return
    if target is None:
        raise UsageError("say what to measure: TARGET, or --cluster FILE", field="TARGET")
    if clients is not None:
        raise UsageError("--clients applies to --cluster", field="--clients")
    size, _ = resolve_object(model, dtype, block_tokens, tp, block_bytes)
    qds = _qds(qd_text)
    patterns = _csv(pattern_text, PATTERNS, "--pattern")
    if read_only:
        patterns = [p for p in patterns if p.endswith("read")]
        if not patterns:
            raise UsageError("--read-only leaves no pattern to run", field="--pattern")
    paths = _csv(path_text, PATHS, "--path") if path_text else None
    if not 0 < seconds < math.inf:  # also refuses nan, which would compare false
        raise UsageError(f"must be a positive number, got {seconds}", field="--seconds")
    if need_gbps is not None and not 0 < need_gbps < math.inf:
        raise UsageError(f"must be a positive number of GB/s, got {need_gbps}", field="--need")
    if ops is not None and ops < 1:
        raise UsageError(f"must be at least 1, got {ops}", field="--ops")
    with progress("bench (cases)") as bar:
        result = bench(target, object_bytes=size, qds=qds, patterns=patterns, paths=paths,
                       seconds=seconds, max_ops=ops, repeat=repeat, need_gbps=need_gbps,
                       region_bytes=parse_size(region, field="--region", allow_zero=False),
                       force=force, lba=parse_lba(lba), credentials=credentials,
                       create_bytes=parse_size(create, field="--create", allow_zero=False)
                       if create else None, progress=bar.advance, on_total=bar.set_total)
    if result["wrote"]:
        note(f"{target}: the first {format_size(result['region_bytes'])} now holds benchmark "
             "data (a later kvtool bench may overwrite it without --force)")
    emit(result, lambda c: render(c, result))
    if result["interrupted"]:
        note("interrupted: the report covers the runs finished before Ctrl-C")
        raise SystemExit(130)
    short = [v for v in result["verdicts"] or [] if v["verdict"] == "short"]
    if short:
        raise CheckFailed(f"{', '.join(v['pattern'] for v in short)} fell short of "
                          f"{need_gbps} GB/s in every run")


def _given(ctx: click.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source != click.core.ParameterSource.DEFAULT


def _bench_cluster(file: str, model: str | None, dtype: str | None, tp: int | None,
                   block_bytes: int | None, block_tokens: int, qd_text: str,
                   pattern_text: str, seconds: float, clients: int | None,
                   region: str | None, force: bool) -> None:
    from kvtool.cluster.bench import bench_cluster, cluster_object_bytes
    from kvtool.cluster.state import load_state

    state = load_state(file)
    if state is None:
        raise UsageError(f"{file}: no such cluster is up (kvtool cluster up {file})",
                         field="--cluster")
    if model is None and block_bytes is None:  # the cluster file's block
        size = cluster_object_bytes(state)
    else:
        size, _ = resolve_object(model, dtype, block_tokens, tp, block_bytes)
    if not 0 < seconds < math.inf:
        raise UsageError(f"must be a positive number, got {seconds}", field="--seconds")
    result = bench_cluster(state, object_bytes=size, patterns=_csv(pattern_text, PATTERNS,
                                                                    "--pattern"),
                           qds=_qds(qd_text), seconds=seconds, clients=clients,
                           region_bytes=parse_size(region, field="--region", allow_zero=False)
                           if region else None, force=force)
    emit(result, lambda c: render_cluster(c, result))


def render_cluster(c: Console, r: dict[str, Any]) -> None:
    from rich import box

    from kvtool.cli.output import Column, print_table

    c.print(f"cluster [bold]{r['cluster']}[/]: {r['clients']} client node"
            f"{'s' if r['clients'] > 1 else ''} at once, objects {r['object_bytes']:,} B, "
            f"{r['seconds']:g} s per case (measured)")
    rows: list[list[str] | None] = []
    for case in r["cases"]:
        for n in case["nodes"]:
            link = "-" if n["link_mbit"] is None else f"{n['link_mbit']:g}"
            rows.append([case["pattern"], str(case["qd"]), n["node"], f"{n['gb_per_s']:.4f}",
                         f"{n['iops']:,.0f}", f"{n['lat_us']['p50']:,.0f}", link])
        a = case["aggregate"]
        rows.append([case["pattern"], str(case["qd"]), "[bold]all[/]",
                     f"[bold]{a['gb_per_s']:.4f}[/]", f"{a['iops']:,.0f}", "", ""])
    print_table(c, [Column("pattern", justify="left"), Column("QD"),
                    Column("node", justify="left"), Column("GB/s"), Column("IOPS"),
                    Column("p50 µs", rank=2), Column("link Mb/s", rank=1)],
                rows, box=box.SIMPLE_HEAD, more="--json has them")
    for case in r["cases"]:
        if case["aggregate"]["late"]:
            c.print(f"[yellow]{case['pattern']} QD {case['qd']}: started late on "
                    f"{', '.join(case['aggregate']['late'])}[/] (the aggregate counts the "
                    "whole span)")


def _range(span: list[float], fmt: str) -> str:
    lo, hi = span
    return format(lo, fmt) if lo == hi else f"{lo:{fmt}}–{hi:{fmt}}"


def render(c: Console, r: dict[str, Any]) -> None:
    from rich import box

    from kvtool.cli.output import Column, print_table

    e = r["engine"]
    padded = {row["path"]: row["object_bytes"] for row in r["results"]}
    objects = ", ".join(f"{p} {n:,} B" for p, n in padded.items())
    runs = r["repeat"]
    c.print(f"[bold]{shown_path(r['target'])}[/] ({e['kind']}, {e['lba_size']} B LBA); objects: {objects}; "
            f"region {format_size(r['region_bytes'])}; {runs} run{'s' if runs > 1 else ''} "
            f"of {r['seconds_per_case']:g} s per case (measured)")
    cols = [Column("pattern", justify="left"), Column("QD"), Column("path", justify="left"),
            Column("GB/s\n(median)"), Column("GB/s range", rank=1 if runs > 1 else 9),
            Column("IOPS", rank=2), Column("p50 µs", rank=3), Column("p99 µs", rank=4),
            Column("p99.9 µs", rank=5)]
    rows: list[list[str] | None] = []
    for row in r["results"]:
        lat = row["lat_us"]
        rows.append([row["pattern"], str(row["qd"]), row["path"], f"{row['gb_per_s']:.3f}",
                     _range(row["gb_per_s_range"], ".3f"), f"{row['iops']:,.0f}",
                     f"{lat['p50']:,.0f}", f"{lat['p99']:,.0f}", f"{lat['p99_9']:,.0f}"])
    print_table(c, cols, rows, box=box.SIMPLE_HEAD, more="--json has them")
    for b in r["bounce_cost"]:
        what = f"bounce vs aligned, {b['pattern']} QD {b['qd']}: {b['bounce_over_aligned']:.2f}×"
        if b["beyond_spread"]:
            c.print(f"{what} IOPS: [bold]bounce {'slower' if b['cost'] > 0 else 'faster'}[/] "
                    f"by {abs(b['cost']):.0%}, beyond the spread of the runs")
        elif runs > 1:
            c.print(f"[dim]{what} IOPS: no difference beyond the spread of the runs[/]")
        else:
            c.print(f"[dim]{what} IOPS from one run: --repeat 3 tells it from noise[/]")
    for v in r["verdicts"] or []:
        colour = {"meets": "green", "short": "red"}.get(v["verdict"], "yellow")
        said = {"meets": "meets", "short": "falls short of",
                "within spread": "is within the spread of"}[v["verdict"]]
        c.print(f"[{colour}]{v['pattern']} {said} {v['need_gb_per_s']:g} GB/s[/]: best "
                f"{v['path']} QD {v['qd']}, {_range(v['gb_per_s_range'], '.3f')} GB/s "
                f"over {runs} run{'s' if runs > 1 else ''}")
    if r.get("interrupted"):
        c.print("[yellow]interrupted[/]: cases not run are missing; ranges cover the runs done")
