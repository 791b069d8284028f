"""``kvtool replay``: a request trace through a tiered prefix cache (thin shell over
:mod:`kvtool.cache`). JSON schema and semantics: docs/replay.md."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvtool.cli.hostopts import host_options
from kvtool.cli.options import block_size_options
from kvtool.cli.output import emit, json_option, note, progress, settings, want_json
from kvtool.errors import CheckFailed, UsageError
from kvtool.units import format_size

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

POLICY_NAMES = ("lru", "lru-tail-first", "radix", "prefix-fair", "oracle", "mooncake", "arc", "s3fifo",
                "lfu", "vllm-lru", "vllm-arc")

EPILOG = """
\b
Examples:
  kvtool replay trace.jsonl        # data mode, default tiers (after: kvtool target up)
  kvtool replay trace.jsonl --gpu 64MiB --dram 256MiB --nvme 512MiB@/var/tmp/kv-cache.img
  kvtool replay trace.jsonl --dram 512MiB --read-qd 32 \\
      --nvme nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:default/1
  kvtool replay conversation_trace.jsonl --format mooncake --block-tokens 512 \\
      --simulate --gpu 1000000tok --dram 3000000tok --nvme inf --json
  kvtool replay mt.jsonl --simulate --model deepseek-v4-flash --dtype fp8 \\
      --compare 'dram=429.5GB' --compare 'dram=53.7GB,nvme=46.09TB' --plot cmp.png
  kvtool replay mt.jsonl --simulate --tiers tiers.toml --csv rounds.csv

\b
Data mode (default) moves real bytes: a CPU "GPU" pool, a DRAM pool and an NVMe tier on
kvtool's object store; every block loaded is checked. --simulate counts metadata only
(what-ifs no machine holds). A tier option is a size, a place or SIZE@PLACE.
--compare SPEC (repeatable) adds a configuration: comma-separated key=value with
gpu, dram, nvme (as the tier options), policy, gpu-policy, dram-policy, nvme-policy,
write-policy, watermark, evict-ratio, label.
"""


def _tier(_ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    from kvtool.tiers.option import TierOption

    return TierOption.parse(value, tier=str(param.name))


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
@click.option("--simulate", is_flag=True,
              help="Count metadata only (no bytes move): for capacities no machine holds.")
@click.option("--gpu", callback=_tier, metavar="SIZE",
              help="CPU \"GPU\" tier size (0/absent: none) [data-mode default 128MiB].")
@click.option("--dram", callback=_tier, metavar="SIZE",
              help="DRAM tier: bytes (1GiB), blocks (5859blk), tokens (3000000tok); inf with "
                   "--simulate [data-mode default 256MiB].")
@click.option("--nvme", callback=_tier, metavar="[SIZE@]PLACE",
              help="NVMe tier: a size, a place (file, block device, nvme+tcp:// URL) or "
                   "SIZE@PLACE [data-mode default: the running kvtool target].")
@click.option("--policy", type=click.Choice(POLICY_NAMES), default=None,
              help="Eviction policy of every tier [default: lru; data-mode default tiers: "
                   "gpu lru-tail-first, dram/nvme lru].")
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
@click.option("--read-qd", type=int, default=16, show_default=True,
              help="Data mode: NVMe-tier reads in flight per request.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Data mode: seed of the block payloads (content = f(chain hash, seed)).")
@click.option("--on-tier-error", type=click.Choice(["fail", "recompute"]), default="fail",
              show_default=True,
              help="Data mode, a tier's medium fails: stop (exit 1), or go on with the tier "
                   "treated as empty.")
@click.option("--skip-bad", type=int, default=0, show_default=True,
              help="Tolerate up to N bad trace lines (reported).")
@click.option("--prefill-tps", type=float, default=None,
              help="Modelled prefill rate, tokens/s [default 10000].")
@click.option("--tpot-ms", type=float, default=None, help="Modelled time per output token [default 20].")
@click.option("--read-gbps", multiple=True, callback=_read_gbps, metavar="TIER=GBPS",
              help="--simulate: modelled load rate of a tier [defaults: gpu inf, dram 25, nvme 5.2].")
@click.option("--concurrency", type=int, default=None,
              help="Requests in flight for modelled round wall time [default 1].")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write per-round rows to this CSV file.")
@click.option("--requests-csv", "requests_csv", type=click.Path(dir_okay=False), default=None,
              help="Write one row per request (and configuration) to this CSV file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: hit ratio and bytes written per round (needs the plot extra).")
@click.option("--iolog", type=click.Path(dir_okay=False), default=None,
              help="--simulate: write the NVMe tier's reads and writes as a fio iolog "
                   "(fio --read_iolog=FILE).")
@click.option("--iolog-version", type=click.Choice(["2", "3"]), default="3", show_default=True,
              help="fio iolog format (3 carries times in ms).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT while replaying.")
@json_option
@host_options
def command(trace: str, simulate: bool, gpu: Any, dram: Any, nvme: Any, policy: str | None,
            tiers_file: str | None, write_policy: str | None, watermark: float | None,
            evict_ratio: float | None, block_tokens: int | None, fmt: str, model: str | None,
            dtype: str | None, tp: int | None, block_bytes: int | None,
            compares: tuple[str, ...], read_qd: int, seed: int, on_tier_error: str,
            skip_bad: int, prefill_tps: float | None, tpot_ms: float | None,
            read_gbps: dict[str, float], concurrency: int | None, csv_path: str | None,
            requests_csv: str | None, plot_path: str | None, iolog: str | None,
            iolog_version: str, metrics_port: int | None,
            credentials: HostCredentials | None) -> None:
    """Replay a request trace through a GPU → DRAM → NVMe prefix cache.

    Data mode (default) moves real bytes through the tiers and checks every block;
    --simulate counts metadata only. Reports the token hit ratio by tier, recomputed
    tokens, puts and promotions per tier, bytes per link (measured in data mode),
    corrupt/lost blocks, the collapse round and TTFT, per round and in total
    (definitions: docs/definitions.md; schema: docs/json.md).
    """
    from kvtool.cache.report import check_output_paths
    from kvtool.replay.run import ReplaySettings, describe_setup, prepare

    check_output_paths(csv=csv_path, plot=plot_path, requests_csv=requests_csv, iolog=iolog)
    replay_settings = ReplaySettings(
        trace=trace, fmt=fmt, block_tokens=block_tokens, skip_bad=skip_bad, simulate=simulate,
        tiers={k: v for k, v in (("gpu", gpu), ("dram", dram), ("nvme", nvme)) if v is not None},
        policy=policy, tiers_file=tiers_file, write_policy=write_policy, watermark=watermark,
        evict_ratio=evict_ratio, compares=compares, model=model, dtype=dtype, tp=tp,
        block_bytes=block_bytes, prefill_tps=prefill_tps, tpot_ms=tpot_ms,
        read_gbps=read_gbps, concurrency=concurrency, read_qd=read_qd, seed=seed,
        on_tier_error=on_tier_error, requests_csv=requests_csv, credentials=credentials,
        iolog=iolog, iolog_version=int(iolog_version))
    if not settings().debug:
        # A lost target is reported once, as one line naming the tier and its URL; the
        # host's reconnect attempts would repeat it (--debug shows them).
        logging.getLogger("kvtool.nvme").setLevel(logging.ERROR)
    job = prepare(replay_settings, on_event=lambda m: note(f"[yellow]{m}[/]"))
    if not simulate:
        for line in describe_setup(job.setup):
            note(line)
    sink = None
    if metrics_port is not None:
        from kvtool.metrics import serve_metrics

        metrics = serve_metrics(metrics_port)
        metrics.block_bytes, metrics.block_tokens = job.block_bytes, job.block_tokens
        note(f"metrics on http://127.0.0.1:{metrics.port}/metrics")
        labels = [c.label for c in job.configs]

        def sink(i: int, outcome: Any) -> None:
            metrics.request(labels[i], outcome)
    with progress("replay", job.total, unit="requests") as advance:
        doc = job.run(progress=advance, on_request=sink)
    results = doc.get("configs") or [doc]
    if csv_path:
        from kvtool.cache.report import write_csv

        write_csv(results, csv_path)
    if plot_path:
        from kvtool.cache.report import write_plot

        write_plot(results, plot_path, title=f"kvtool replay {Path(trace).name}")
    if doc["bad_lines"] and not want_json():
        for b in doc["bad_lines"]:
            note(f"[yellow]skipped bad line {b['line']}: {b['message']}[/]")
    emit(doc, lambda con: _render(con, results, doc))
    if doc.get("iolog") and not want_json():
        lg = doc["iolog"]
        note(f"fio iolog v{lg['version']}: {lg['path']} ({lg['reads']:,} reads, {lg['writes']:,} "
             f"writes of {lg['block_bytes']:,} B; replay on ≥ {lg['device_bytes']:,} B: "
             f"fio --name=kv --read_iolog={lg['path']} --replay_redirect=DEVICE)")
    if doc["interrupted"]:
        note("interrupted: the report covers the requests served before Ctrl-C")
        raise SystemExit(130)
    # Corrupt blocks, or objects lost from a tier that kept working, are a failed check;
    # a tier that failed under --on-tier-error recompute was asked for and said so.
    if any(r.get("corrupt_blocks") or (r.get("lost_blocks") and
                                       not any(t.get("failed") for t in r["tiers"]))
           for r in results):
        raise CheckFailed("corrupt or lost blocks were found (recomputed, never served); "
                          "see the report")


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
                 if head.get("block_size") and head["block_size"]["tp"] > 1 else "")
              + f", {head['mode']} mode)")
    if len(results) == 1:
        _render_one(con, results[0], Table)
    else:
        _render_compare(con, results, Table)
    if head["mode"] == "data":
        _render_data(con, results, Table)
        con.print("[dim]Link bytes, seconds and load times are measured; prefill and decode "
                  "times are modelled (docs/replay.md).[/]")
    else:
        con.print("[dim]Times are modelled (prefill rate, tier read rates, TPOT; "
                  "docs/replay.md), not measured.[/]")


def _render_one(con: Any, res: dict[str, Any], Table: Any) -> None:
    tiers = [t["name"] for t in res["tiers"]]
    names = "/".join(tiers)
    t = Table(title=f"{res['label']} · {res['write_policy']}", title_justify="left")
    for col in ["round" if res["round_kind"] != "window" else "minute", "reqs", "hit ratio",
                f"hit {names}", "recompute tok", f"puts {names}", f"promotions {names}",
                f"evictions {names}",
                "TTFT p50", "TTFT p99", "wall"]:
        t.add_column(col, justify="right")

    def cells(r: dict[str, Any]) -> list[str]:
        return [str(r["requests"]), _pct(r["token_hit_ratio"]),
                " / ".join(_pct(r["hit_ratio_by_tier"][n]) for n in tiers),
                f"{r['recompute_tokens']:,}",
                " / ".join(_amount(r["put_blocks"][n], r["put_bytes"][n]) for n in tiers),
                " / ".join(_amount(r["promoted_blocks"][n], r["promoted_bytes"][n])
                           for n in tiers),
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
              + f" · requests/s (modelled) {res['requests_per_s'] or 0:.2f}"
              + (" · [yellow]interrupted[/]" if res.get("interrupted") else ""))


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


def _render_data(con: Any, results: list[dict[str, Any]], Table: Any) -> None:
    """Data mode: bytes per link (measured), content checks, the NVMe medium's counters."""
    for res in results:
        m = res["measured"]
        t = Table(title="measured links" + (f" · {res['label']}" if len(results) > 1 else ""),
                  title_justify="left")
        for col in ("link", "blocks", "bytes", "seconds", "GB/s"):
            t.add_column(col, justify="right")
        for name, lk in m["links"].items():
            t.add_row(name, f"{lk['blocks']:,}", format_size(lk["bytes"], binary=False),
                      f"{lk['seconds']:.3f}", "–" if lk["gbps"] is None else f"{lk['gbps']:.2f}")
        con.print(t)
        colour = "red" if res["corrupt_blocks"] or res["lost_blocks"] else "green"
        con.print(f"[{colour}]verified {res['verified_blocks']:,} blocks · corrupt "
                  f"{res['corrupt_blocks']:,} · lost {res['lost_blocks']:,} · recomputed "
                  f"{res['recomputed_blocks']:,}[/] · load p50 {_secs(m['load_s']['p50'])} "
                  f"p99 {_secs(m['load_s']['p99'])} (measured) · replay overhead "
                  + ("–" if m["overhead_us_per_block"] is None
                     else f"{m['overhead_us_per_block']:.1f} µs/block")
                  + f" · wall {m['wall_s']:.2f} s")
        for p in res["problems"][:10]:
            con.print(f"  [red]{p['kind']}[/] block {p['key']:#x} in {p['tier']} "
                      f"(round {p['round']}, trace line {p['line']}): recomputed, not served")
        for t_ in res["tiers"]:
            if t_.get("failed"):
                con.print(f"  [red]{t_['name']} tier failed[/]: {t_['failed']}")
        media = res.get("media")
        if media and "error" not in media and not media["counted"]:
            con.print("NVMe medium: its SMART log counted no writes for this namespace (Linux "
                      "nvmet counts only block devices with I/O accounting, not brd or files)")
        elif media and "error" not in media:
            con.print(f"NVMe medium (SMART Data Units Written): "
                      f"{format_size(media['media_bytes_written'], binary=False)} written "
                      f"during the run · replay put {format_size(media['replay_put_bytes'], binary=False)}"
                      f" ({format_size(media['replay_padded_bytes'], binary=False)} padded "
                      f"+ {format_size(media['store_metadata_bytes'], binary=False)} store "
                      "metadata)")


def _sum_or_none(values: dict[str, int | None]) -> int | None:
    if any(v is None for v in values.values()):
        return None
    return sum(v for v in values.values() if v is not None)
