"""``kvtool replay``: a request trace through a tiered prefix cache (thin shell over
:mod:`kvtool.cache`). JSON schema and semantics: docs/replay.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvtool.cli.options import block_size_from, block_size_options
from kvtool.cli.output import emit, json_option, note, progress, want_json
from kvtool.errors import UsageError
from kvtool.units import Capacity, format_size

POLICY_NAMES = ("lru", "lru-tail-first", "radix", "prefix-fair", "oracle", "mooncake")

EPILOG = """
\b
Examples:
  kvtool replay trace.jsonl --dram 3000000tok
  kvtool replay conversation_trace.jsonl --format mooncake --block-tokens 512 \\
      --gpu 1000000tok --dram 3000000tok --nvme inf --json
  kvtool replay mt.jsonl --model deepseek-v4-flash --dtype fp8 \\
      --compare 'dram=429.5GB' --compare 'dram=53.7GB,nvme=46.09TB' --plot cmp.png
  kvtool replay mt.jsonl --tiers tiers.toml --csv rounds.csv

\b
--compare SPEC (repeatable) adds a configuration: comma-separated key=value with
gpu, dram, nvme (sizes), policy, gpu-policy, dram-policy, nvme-policy, write-policy,
watermark, evict-ratio, label. Times in the report are modelled, not measured.
"""


def _capacity(_ctx: click.Context, param: click.Parameter, value: str | None) -> Capacity | None:
    if value is None:
        return None
    return Capacity.parse(value, field=f"--{param.name}")


def _read_gbps(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
               ) -> dict[str, float]:
    out: dict[str, float] = {}
    for v in values:
        tier, eq, rate = v.partition("=")
        try:
            gbps = float(rate)
        except ValueError:
            gbps = -1.0
        if not eq or tier not in ("gpu", "dram", "nvme") or not gbps > 0:
            raise UsageError(f"{v!r}: expected TIER=GB/s with TIER gpu, dram or nvme "
                             "(example: nvme=5.2)", field="--read-gbps")
        out[tier] = gbps
    return out


def _fraction(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not 0 < value <= 1:
        raise UsageError(f"must be a fraction in (0, 1], got {value}", field=param.opts[0])
    return value


@click.command("replay", epilog=EPILOG)
@click.argument("trace", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--gpu", callback=_capacity, metavar="SIZE", help="GPU tier capacity (0/absent: none).")
@click.option("--dram", callback=_capacity, metavar="SIZE",
              help="DRAM tier capacity: bytes (429.5GB), blocks (5859blk), tokens (3000000tok), inf.")
@click.option("--nvme", callback=_capacity, metavar="SIZE", help="NVMe tier capacity.")
@click.option("--policy", type=click.Choice(POLICY_NAMES), default=None,
              help="Eviction policy of every tier [default: lru, or the --tiers file's].")
@click.option("--tiers", "tiers_file", type=click.Path(dir_okay=False), default=None,
              help="TOML file: per-tier capacity/policy/watermark and [time] (docs/replay.md).")
@click.option("--write-policy", type=click.Choice(["write-through", "write-back"]), default=None,
              help="write-through: computed blocks go to every tier; write-back: down on "
                   "eviction [default: write-through].")
@click.option("--watermark", type=float, default=None, callback=_fraction,
              help="Mooncake batch eviction on every tier: start above this fill (e.g. 0.9).")
@click.option("--evict-ratio", type=float, default=None, callback=_fraction,
              help="Mooncake batch eviction: fraction evicted per batch (default 0.05).")
@click.option("--block-tokens", type=int, default=None,
              help="Tokens per block [default: the trace's; 256 kvtool, 512 Mooncake].")
@click.option("--format", "fmt", type=click.Choice(["auto", "kvtool", "mooncake"]),
              default="auto", show_default=True, help="Trace format.")
@block_size_options
@click.option("--compare", "compares", multiple=True, metavar="SPEC",
              help="Add a configuration to replay side by side (repeatable; see below).")
@click.option("--skip-bad", type=int, default=0, show_default=True,
              help="Tolerate up to N bad trace lines (reported).")
@click.option("--prefill-tps", type=float, default=None,
              help="Modelled prefill rate, tokens/s [default 10000].")
@click.option("--tpot-ms", type=float, default=None, help="Modelled time per output token [default 20].")
@click.option("--read-gbps", multiple=True, callback=_read_gbps, metavar="TIER=GBPS",
              help="Modelled load rate of a tier [defaults: gpu inf, dram 25, nvme 5.2].")
@click.option("--concurrency", type=int, default=None,
              help="Requests in flight for modelled round wall time [default 1].")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write per-round rows to this CSV file.")
@click.option("--requests-csv", "requests_csv", type=click.Path(dir_okay=False), default=None,
              help="Write one row per request (and configuration) to this CSV file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: hit ratio and bytes written per round (needs the plot extra).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT while replaying.")
@json_option
def command(trace: str, gpu: Capacity | None, dram: Capacity | None, nvme: Capacity | None,
            policy: str | None, tiers_file: str | None, write_policy: str | None,
            watermark: float | None, evict_ratio: float | None, block_tokens: int | None,
            fmt: str, model: str | None, dtype: str | None, tp: int | None, block_bytes: int | None,
            compares: tuple[str, ...], skip_bad: int, prefill_tps: float | None,
            tpot_ms: float | None, read_gbps: dict[str, float], concurrency: int | None,
            csv_path: str | None, requests_csv: str | None, plot_path: str | None,
            metrics_port: int | None) -> None:
    """Replay a request trace through a GPU → DRAM → NVMe prefix cache.

    Reports the token hit ratio by tier, recomputed tokens, bytes written and read per
    tier, evictions, the collapse round, and modelled TTFT / round time, per round and in
    total (definitions: docs/definitions.md).
    """
    from kvtool.cache import replay
    from kvtool.cache.config import (
        build_config,
        load_tiers_file,
        parse_compare,
        time_model_from,
    )
    from kvtool.trace import read_trace

    if concurrency is not None and concurrency < 1:
        raise UsageError(f"must be at least 1, got {concurrency}", field="--concurrency")
    if prefill_tps is not None and not prefill_tps > 0:
        raise UsageError(f"must be positive, got {prefill_tps}", field="--prefill-tps")
    if tpot_ms is not None and not tpot_ms >= 0:
        raise UsageError(f"must be a number ≥ 0, got {tpot_ms}", field="--tpot-ms")
    for path, option in ((csv_path, "--csv"), (plot_path, "--plot"),
                         (requests_csv, "--requests-csv")):
        # Fail before a long replay, not after it.
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"cannot write {path}: no such directory", field=option)
    tf = load_tiers_file(tiers_file) if tiers_file else None
    reader = read_trace(trace, fmt=fmt, block_tokens=block_tokens, skip_bad=skip_bad)
    B = reader.block_tokens
    size = block_size_from(model, dtype, tp, block_bytes, B)
    block_bytes = size.block_bytes if size else None
    configs = []
    caps = {"gpu": gpu, "dram": dram, "nvme": nvme}
    if any(c is not None for c in caps.values()) or tf is not None or not compares:
        configs.append(build_config(caps, policy=policy, write_policy=write_policy,
                                    watermark=watermark, evict_ratio=evict_ratio,
                                    tiers_file=tf))
    configs += [parse_compare(spec, policy=policy, write_policy=write_policy, tiers_file=tf)
                for spec in compares]
    tm = time_model_from(tf.time if tf else {}, prefill_tps=prefill_tps, tpot_ms=tpot_ms,
                         read_gbps=read_gbps, concurrency=concurrency)
    per_request = None
    if requests_csv:
        from kvtool.cache.report import RequestCsv

        per_request = RequestCsv(requests_csv, [c.label for c in configs])
    on_request: Any = per_request
    if metrics_port is not None:
        from kvtool.metrics import serve_metrics

        metrics = serve_metrics(metrics_port)
        metrics.block_bytes, metrics.block_tokens = block_bytes, B
        note(f"metrics on http://127.0.0.1:{metrics.port}/metrics")
        on_request = _metered([c.label for c in configs], metrics, per_request)
    try:
        with progress("replay", len(reader), unit="requests") as advance:
            results = replay(reader, configs, block_tokens=B, block_bytes=block_bytes,
                             time_model=tm, progress=advance, on_request=on_request)
    finally:
        if per_request is not None:
            per_request.close()
    bad = [{"line": line, "message": msg} for line, msg in reader.bad_lines]
    if csv_path:
        from kvtool.cache.report import write_csv

        write_csv(results, csv_path)
    if plot_path:
        from kvtool.cache.report import write_plot

        write_plot(results, plot_path, title=f"kvtool replay {Path(trace).name}")
    head = {"schema": "kvtool.replay/1", "trace": trace, "format": reader.format, "block_tokens": B,
            "block_bytes": block_bytes, "block_size": size.to_dict() if size else None,
            "bad_lines": bad}
    doc: dict[str, Any] = {**head, **results[0]} if len(results) == 1 else {
        **head, "configs": results}
    if bad and not want_json():
        for b in bad:
            note(f"[yellow]skipped bad line {b['line']}: {b['message']}[/]")
    emit(doc, lambda con: _render(con, results, head))


def _metered(labels: list[str], metrics: Any, also: Any) -> Any:
    """An ``on_request`` sink feeding Prometheus counters, then ``also`` (when given)."""

    def sink(i: int, outcome: Any) -> None:
        metrics.request(labels[i], outcome)
        if also is not None:
            also(i, outcome)

    return sink


# -- human output -----------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _secs(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _amount(blocks: int | None, nbytes: int | None) -> str:
    if nbytes is not None:
        return format_size(nbytes, binary=False)
    return "–" if blocks is None else f"{blocks:,} blk"


def _render(con: Any, results: list[dict[str, Any]], head: dict[str, Any]) -> None:
    from rich.table import Table

    con.print(f"[bold]kvtool replay[/] {head['trace']} ({head['format']}, "
              f"{head['block_tokens']} tokens/block"
              + (f", {format_size(head['block_bytes'], binary=False)}/block"
                 if head["block_bytes"] else "")
              + (f" per rank of {head['block_size']['tp']}"
                 if head["block_size"] and head["block_size"]["tp"] > 1 else "") + ")")
    if len(results) == 1:
        _render_one(con, results[0], Table)
    else:
        _render_compare(con, results, Table)
    con.print("[dim]Times are modelled (prefill rate, tier read rates, TPOT; docs/replay.md), "
              "not measured.[/]")


def _render_one(con: Any, res: dict[str, Any], Table: Any) -> None:
    tiers = [t["name"] for t in res["tiers"]]
    names = "/".join(tiers)
    t = Table(title=f"{res['label']} · {res['write_policy']}", title_justify="left")
    for col in ["round" if res["round_kind"] != "window" else "minute", "reqs", "hit ratio",
                f"hit {names}", "recompute tok", f"written {names}", f"evictions {names}",
                "TTFT p50", "TTFT p99", "wall"]:
        t.add_column(col, justify="right")

    def cells(r: dict[str, Any]) -> list[str]:
        return [str(r["requests"]), _pct(r["token_hit_ratio"]),
                " / ".join(_pct(r["hit_ratio_by_tier"][n]) for n in tiers),
                f"{r['recompute_tokens']:,}",
                " / ".join(_amount(r["blocks_written"][n], r["bytes_written"][n]) for n in tiers),
                " / ".join(f"{r['evictions'][n]:,}" for n in tiers),
                _secs(r["ttft_p50_s"]), _secs(r["ttft_p99_s"]), _secs(r["wall_s"])]

    for r in res["rounds"]:
        mark = " ◀ cliff" if r["round"] == res["cliff_round"] else ""
        t.add_row(f"{r['round']}{mark}", *cells(r))
    t.add_section()
    t.add_row("total", *cells(res))
    con.print(t)
    cliff = res["cliff_round"]
    con.print(f"token hit ratio [bold]{_pct(res['token_hit_ratio'])}[/] · collapse round "
              + (f"[bold red]{cliff}[/]" if cliff is not None else "[green]none[/]")
              + f" · requests/s (modelled) {res['requests_per_s'] or 0:.2f}")


def _render_compare(con: Any, results: list[dict[str, Any]], Table: Any) -> None:
    s = Table(title="configurations side by side", title_justify="left")
    s.add_column("")
    for res in results:
        s.add_column(res["label"], justify="right")
    rows: list[tuple[str, Any]] = [
        ("token hit ratio", lambda r: _pct(r["token_hit_ratio"])),
        ("collapse round", lambda r: "none" if r["cliff_round"] is None else str(r["cliff_round"])),
        ("recompute tokens", lambda r: f"{r['recompute_tokens']:,}"),
        ("written (all tiers)", lambda r: _amount(sum(r["blocks_written"].values()),
                                                  _sum_or_none(r["bytes_written"]))),
        ("evictions (all tiers)", lambda r: f"{sum(r['evictions'].values()):,}"),
        ("TTFT p50", lambda r: _secs(r["ttft_p50_s"])),
        ("TTFT p99", lambda r: _secs(r["ttft_p99_s"])),
        ("wall (modelled)", lambda r: _secs(r["wall_s"])),
    ]
    for name, fn in rows:
        s.add_row(name, *[fn(r) for r in results])
    con.print(s)
    per = Table(title="token hit ratio per round", title_justify="left")
    per.add_column("round" if results[0]["round_kind"] != "window" else "minute", justify="right")
    for res in results:
        per.add_column(res["label"], justify="right")
    by_round = [{r["round"]: r for r in res["rounds"]} for res in results]
    for rnd in sorted({k for d in by_round for k in d}):
        cells = []
        for res, d in zip(results, by_round, strict=True):
            r = d.get(rnd)
            mark = " ◀" if rnd == res["cliff_round"] else ""
            cells.append("–" if r is None else _pct(r["token_hit_ratio"]) + mark)
        per.add_row(str(rnd), *cells)
    con.print(per)


def _sum_or_none(values: dict[str, int | None]) -> int | None:
    if any(v is None for v in values.values()):
        return None
    return sum(v for v in values.values() if v is not None)
