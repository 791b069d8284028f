"""``kvtool plan``: hit ratio against capacity of a trace (``plan TRACE``), or the collapse
round, capacity per tier and expected hit ratio of a workload described by numbers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import click

from kvtool.cache.names import WRITE_POLICIES
from kvtool.cli.options import block_size_from, block_size_options
from kvtool.cli.output import emit, json_option, progress
from kvtool.errors import UsageError, param
from kvtool.plan.capacity import AnswerKV, Storage, Workload, WritePolicy, plan
from kvtool.units import Capacity, format_size, parse_percent

if TYPE_CHECKING:
    from rich.console import Console

EPILOG = """
\b
Examples:
  kvtool plan conversation_trace.jsonl --model deepseek-v4-flash --dtype fp8
  kvtool plan trace.jsonl --block-bytes 1002240 --plot plan.png --json
  kvtool plan trace.jsonl --policy prefix-fair --sweep 12
  kvtool plan --sessions 112 --input-tokens 109030 --output-tokens 5000 --dram 429.5GB \\
      --model deepseek-v4-flash --dtype fp8
  kvtool plan --sessions 112 --input-tokens 109030 --output-tokens 5000 --dram 53.7GB \\
      --nvme 46.09TB --model deepseek-v4-flash --dtype fp8 --watermark 90% --rounds 50
  kvtool plan --sessions 16 --input-tokens 2000 --output-tokens 500 --dram 2000blk \\
      --block-tokens 256 --answer-kv next-round --json
"""


def _capacity(text: str | None, field: str) -> Capacity | None:
    if text is None:
        return None
    if text.strip().startswith("-"):
        raise UsageError(f"must not be negative, got {text!r}", field=field)
    return Capacity.parse(text, field=field)


def _watermark(text: str) -> float:
    return parse_percent(text, field="--watermark")


FORMULA_ONLY = ("sessions", "input_tokens", "output_tokens", "system_prompt_tokens", "rounds",
                "dram", "gpu", "nvme", "watermark", "replicas", "answer_kv", "write_policy")
TRACE_ONLY = ("fmt", "plot_path", "policy", "sweep", "sample_limit", "skip_bad")


@click.command("plan", epilog=EPILOG)
@click.argument("trace", required=False, type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--sessions", "-C", type=int, help="Formula: concurrent sessions C.")
@click.option("--input-tokens", type=int, help="Formula: new input tokens N per session per round.")
@click.option("--output-tokens", type=int, help="Formula: answer tokens M per session per round.")
@click.option("--system-prompt-tokens", type=int, default=0, show_default=True,
              help="Formula: shared system prompt S (stored once).")
@click.option("--rounds", type=int, default=20, show_default=True,
              help="Formula: rounds R to plan for (capacity needed, steady hit ratio).")
@click.option("--dram", metavar="SIZE",
              help="Formula: DRAM tier: bytes (429.5GB), blocks (5859blk), tokens (3000000tok), "
                   "inf.")
@click.option("--gpu", metavar="SIZE", help="Formula: GPU tier (0 or absent: none).")
@click.option("--nvme", metavar="SIZE",
              help="Formula: NVMe tier (absent: the with-NVMe scenario uses one sized to the "
                   "need).")
@click.option("--block-tokens", type=int, default=None,
              help="Tokens per block B [formula: 256; TRACE: the trace's].")
@block_size_options
@click.option("--watermark", "watermark", default="100%", show_default=True, metavar="h",
              help="Formula: usable fraction h of each tier (Mooncake evicts at 90%).")
@click.option("--replicas", type=int, default=1, show_default=True, help="Formula: replicas ρ.")
@click.option("--answer-kv", type=click.Choice(["stored", "next-round"]), default="stored",
              show_default=True,
              help="Formula. stored: an answer's KV is written in its own round (vLLM offload, "
                   "LMCache); next-round: when the next round re-sends it (kvtool replay).")
@click.option("--write-policy", type=click.Choice(WRITE_POLICIES),
              default="write-through", show_default=True,
              help="Formula. write-through: the largest tier bounds the hierarchy; write-back: "
                   "the sum.")
@click.option("--format", "fmt", type=click.Choice(["auto", "kvtool", "mooncake"]),
              default="auto", show_default=True, help="TRACE: its format.")
@click.option("--policy", default="lru", show_default=True,
              type=click.Choice(["lru", "lru-tail-first", "radix", "prefix-fair", "oracle",
                                 "mooncake"]),
              help="TRACE: eviction policy of the tier (only lru has a one-pass curve; the "
                   "others need --sweep).")
@click.option("--sweep", type=click.IntRange(2, 200), default=None, metavar="N",
              help="TRACE: replay N capacities, log-spaced up to the trace's footprint.")
@click.option("--sample-limit", type=click.IntRange(1), default=None, metavar="BLOCKS",
              help="TRACE: follow at most this many distinct blocks; beyond, sample them "
                   "as SHARDS does (an estimate) [default: 2097152].")
@click.option("--skip-bad", type=int, default=0, show_default=True,
              help="TRACE: tolerate up to N bad trace lines.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="TRACE: write a PNG of hit ratio against capacity (needs the plot extra).")
@json_option
@click.pass_context
def command(ctx: click.Context, trace: str | None, sessions: int | None,
            input_tokens: int | None, output_tokens: int | None, system_prompt_tokens: int,
            rounds: int, dram: str | None, gpu: str | None, nvme: str | None,
            block_tokens: int | None, model: str | None, dtype: str | None, tp: int | None,
            block_bytes: int | None, watermark: str, replicas: int, answer_kv: str,
            write_policy: str, fmt: str, policy: str, sweep: int | None,
            sample_limit: int | None, skip_bad: int, plot_path: str | None) -> None:
    """How much cache a workload needs: from a trace, or from the capacity formula.

    kvtool plan TRACE: the token hit ratio of one cache tier against its capacity, for
    every capacity, in one pass over the trace (LRU stack distances; exact, and equal to
    kvtool replay --simulate at any size); prints the capacity, in bytes of --model's KV,
    at which the hit ratio reaches 50, 80, 90, 95 and 99 % of the trace's maximum.

    kvtool plan --sessions C --input-tokens N --output-tokens M --dram SIZE: the
    capacity formula (docs/definitions.md), R = h·M / (ρ·C·b·Δ) with M one rank's tier
    and b = s/B one rank's bytes per token, refined with block rounding and a shared
    system prompt: the cache first evicts a live block in the first round whose
    footprint exceeds h·M. Prints which terms it used, the capacity needed to hold
    --rounds rounds, and hit ratios with and without an NVMe tier.
    """
    given = {name for name in (*FORMULA_ONLY, *TRACE_ONLY)
             if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)}
    if trace is not None:
        wrong = [n for n in FORMULA_ONLY if n in given]
        if wrong:
            raise UsageError(f"{param(wrong[0])} belongs to the formula; with a TRACE the trace "
                             "is the workload (drop one or the other)", field=wrong[0])
        _plan_trace(trace, fmt=fmt, block_tokens=block_tokens, model=model, dtype=dtype, tp=tp,
                    block_bytes=block_bytes, policy=policy, sweep=sweep,
                    sample_limit=sample_limit, skip_bad=skip_bad, plot_path=plot_path)
        return
    wrong = [n for n in TRACE_ONLY if n in given]
    if wrong:
        raise UsageError(f"{param(wrong[0])} needs a TRACE (kvtool plan TRACE …)", field=wrong[0])
    missing = [n for n, v in (("sessions", sessions), ("input_tokens", input_tokens),
                              ("output_tokens", output_tokens), ("dram", dram)) if v is None]
    if missing:
        raise UsageError(f"missing {', '.join(param(n) for n in missing)}: the formula needs "
                         f"{param('sessions')}, {param('input_tokens')}, "
                         f"{param('output_tokens')} and {param('dram')}; or give a trace: "
                         "kvtool plan TRACE", field=missing[0])
    assert sessions is not None and input_tokens is not None and output_tokens is not None
    block_tokens = 256 if block_tokens is None else block_tokens
    workload = Workload(sessions=sessions, rounds=rounds, input_tokens=input_tokens,
                        output_tokens=output_tokens, system_prompt_tokens=system_prompt_tokens,
                        block_tokens=block_tokens, answer_kv=cast(AnswerKV, answer_kv))
    size = block_size_from(model, dtype, tp, block_bytes, block_tokens)
    storage = Storage(size.block_bytes if size else None, replicas, _watermark(watermark),
                      cast(WritePolicy, write_policy), size)
    caps = {name: _capacity(text, f"--{name}") for name, text in
            (("gpu", gpu), ("dram", dram), ("nvme", nvme))}
    dram_cap = caps["dram"]
    assert dram_cap is not None
    if dram_cap.is_zero:
        raise UsageError("a DRAM tier is required (the formula's M)", field="--dram")
    result = plan(workload, storage, dram=dram_cap, gpu=caps["gpu"], nvme=caps["nvme"]).to_dict()
    emit(result, lambda con: _render(con, result))


def _plan_trace(trace: str, *, fmt: str, block_tokens: int | None, model: str | None,
                dtype: str | None, tp: int | None, block_bytes: int | None, policy: str,
                sweep: int | None, sample_limit: int | None, skip_bad: int,
                plot_path: str | None) -> None:
    from pathlib import Path

    from kvtool.cache.report import check_output_paths
    from kvtool.plan.curve import (
        DEFAULT_MAX_TRACKED,
        lru_curve,
        policy_sweep,
        sweep_capacities,
        trace_document,
    )
    from kvtool.trace.reader import read_trace

    check_output_paths(plot=plot_path)
    if policy != "lru" and sweep is None:
        raise UsageError(f"{policy} has no one-pass curve (only lru has: stack distances); "
                         "add --sweep N to replay it at N capacities", field="policy")
    reader = read_trace(trace, fmt=fmt, block_tokens=block_tokens, skip_bad=skip_bad)
    with progress("plan: one pass", unit="requests") as bar:
        curve = lru_curve(_counting(reader, bar),
                          max_tracked=sample_limit or DEFAULT_MAX_TRACKED)
    bt = curve.block_tokens or reader.block_tokens
    size = block_size_from(model, dtype, tp, block_bytes, bt)
    swept = None
    if sweep is not None:
        caps = sweep_capacities(curve.unique_blocks, sweep)
        with progress(f"plan: {policy} at {len(caps)} sizes", unit="requests") as bar:
            swept = policy_sweep(
                _counting(read_trace(trace, fmt=fmt, block_tokens=block_tokens,
                                     skip_bad=skip_bad), bar),
                policy, caps, block_tokens=bt, input_tokens=curve.input_tokens,
                max_hit_tokens=round(curve.max_hit_tokens), unique_blocks=curve.unique_blocks)
    doc = trace_document(trace, reader.format, curve, swept,
                         size.to_dict() if size else None, reader.bad_lines)
    if plot_path:
        from kvtool.plan.curve import write_curve_plot

        write_curve_plot(doc, plot_path, title=f"kvtool plan {Path(trace).name}")
    emit(doc, lambda con: _render_trace(con, doc))


def _counting(requests: Any, bar: Any) -> Any:
    for req in requests:
        bar(1)
        yield req


def _render_trace(con: Console, d: dict[str, Any]) -> None:
    from rich import box

    from kvtool.cli.output import Column, print_table

    bs = d["block_size"]
    what = (f"{bs['model']} {bs['dtype']}" + (f" tp={bs['tp']}" if bs["tp"] > 1 else "")
            + f", {format_size(d['block_bytes'])}/block" if bs and bs.get("model")
            else f"{format_size(d['block_bytes'])}/block" if d["block_bytes"] else "no --model")
    con.print(f"[bold]kvtool plan[/] {d['trace']} ({d['format']}, {d['block_tokens']} "
              f"tokens/block, {what})")
    basis = ("exact: LRU stack distances, equal to replay at every size" if d["policy"] == "lru"
             and d["exact"] and "replays" not in d["method"]
             else f"estimated: SHARDS sampling at rate {d['sample_rate']:.3g}"
             if not d["exact"] else f"counted: {d['method']}")
    con.print(f"one {d['policy']} tier · {d['requests']:,} requests · "
              f"{d['input_tokens']:,} input tokens · {basis}")
    mx = d["max_token_hit_ratio"]
    full = d["full"]
    con.print(f"trace maximum token hit ratio [bold]{100 * mx:.1f}%[/] (an unbounded "
              f"tier: only first uses miss), reached at {_cap(full)}")
    cols = [Column("% of max"), Column("hit ratio"), Column("capacity"),
            Column("blocks", rank=1), Column("tokens", rank=2)]
    rows: list[list[str] | None] = []
    for t in d["targets"]:
        if t["capacity_blocks"] is None:
            rows.append([f"{t['fraction_of_max']:.0%}", "–", "beyond the sweep", "–", "–"])
            continue
        rows.append([f"{t['fraction_of_max']:.0%}", f"{100 * t['token_hit_ratio']:.1f}%",
                     format_size(t["capacity_bytes"]) if t["capacity_bytes"] is not None
                     else f"{t['capacity_blocks']:,} blk",
                     f"{t['capacity_blocks']:,}", f"{t['capacity_tokens']:,}"])
    print_table(con, cols, rows, box=box.SIMPLE_HEAD, more="--json has them",
                title="tier capacity for a share of the maximum")
    if d["block_bytes"] is None:
        con.print("[dim]Sizes in blocks: --model/--dtype (or --block-bytes) gives bytes.[/]")
    con.print("[dim]Counted from the trace (no time model). A tier of this size serves "
              "these hits whichever tier it is; --plot FILE draws the whole curve.[/]")


def _cap(t: dict[str, Any]) -> str:
    if t["capacity_blocks"] is None:
        return "a size beyond the sweep"
    blocks = f"{t['capacity_blocks']:,} blocks"
    return f"{format_size(t['capacity_bytes'])} ({blocks})" if t["capacity_bytes"] else blocks


def _amount(d: dict[str, Any]) -> str:
    if d["bytes"] is not None:
        return format_size(d["bytes"])
    if d["blocks"] is None or d["blocks"] == float("inf"):
        return "inf"
    return f"{d['blocks']:,.0f} blocks"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def _render(con: Console, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    from kvtool.cli.output import Column, print_table

    w, st, f = r["workload"], r["storage"], r["formula"]
    terms = f["terms"]
    bs = st["block_size"]
    what = (f"{bs['model']} {bs['dtype']} tp={bs['tp']}: {format_size(bs['block_bytes'])}"
            f"/block per rank (t={bs['per_rank_duplication']})" if bs and bs["model"]
            else f"{format_size(st['block_bytes'])}/block" if st["block_bytes"]
            else "sizes in blocks")
    con.print(f"[bold]kvtool plan[/]: C={w['sessions']} sessions, N={w['input_tokens']:,} new + "
              f"M={w['output_tokens']:,} answer tokens/round, S={w['system_prompt_tokens']:,}, "
              f"B={w['block_tokens']}, {what}")
    b = terms["b"]
    m = format_size(terms["M"]) if terms["M"] is not None else f"{terms['M_blocks']:,.0f} blocks"
    con.print(f"formula: {f['expression']} with h={terms['h']:g}, M={m}, ρ={terms['rho']}, "
              f"C={terms['C']}, b={_num(b, ',.1f')} B/token, "
              f"Δ={terms['delta']:,} tokens → R = {_num(f['R'])}")
    con.print("terms used:")
    for line in f["uses"]:
        con.print(f"  • {line}")

    head = Table(box=box.SIMPLE, show_header=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("collapse round (refined)", _num(r["collapse_round"]))
    head.add_row("first round with eviction", _num(r["eviction_round"], "d"))
    head.add_row("expected cliff round (lru, docs/definitions.md)", _num(r["cliff_round"], "d"))
    need = r["capacity_needed"]
    head.add_row(f"capacity to hold {need['rounds']} rounds", _amount(need))
    for tier, d in r["tiers"].items():
        held = d["holds_rounds"]
        head.add_row(f"{tier}: {_amount(d)}", "holds all rounds" if held is None
                     else f"full at round {held:.2f}")
    con.print(head)

    cols = [Column("scenario", justify="left"), Column("tiers", justify="left", wrap=True),
            Column("collapse"), Column("no\neviction", rank=1), Column("lru"),
            Column("best (keep\nsessions)", rank=1)]
    rows: list[list[str] | None] = []
    for name, sc in r["scenarios"].items():
        tiers = ", ".join(f"{k} {_amount(v)}" for k, v in sc["tiers"].items())
        if sc.get("nvme_sized_to_need"):
            tiers += " (sized to need)"
        steady, whole = sc["steady_hit_ratio"], sc["token_hit_ratio"]
        rows.append([name.replace("_", " "), tiers, _num(sc["collapse_round"]),
                     *(f"{steady[k]:.3f} ({whole[k]:.3f})" for k in ("no_eviction", "lru", "best"))])
    print_table(con, cols, rows, box=box.SIMPLE_HEAD, more="--json has them",
                title=f"expected hit ratio at round {w['rounds']} (whole run in brackets)")

    cols = [Column("round"), Column("input\ntokens", rank=3), Column("footprint"),
            Column("new KV", rank=2), Column("writes\n(lru)", rank=2),
            Column("no\neviction", rank=1), Column("lru"), Column("best", rank=1)]
    rows = []
    for row in r["rounds"]:
        fp = (format_size(row["footprint_bytes"]) if row["footprint_bytes"] is not None
              else f"{row['footprint_blocks']:,.0f} blk")
        wr = (format_size(row["writes_bytes"]) if row["writes_bytes"] is not None
              else f"{row['writes_blocks']:,.0f} blk")
        lw = (format_size(row["lru_writes_bytes"]) if row["lru_writes_bytes"] is not None
              else f"{row['lru_writes_blocks']:,.0f} blk")
        h = row["hit_ratio"]
        rows.append([str(row["round"]), f"{row['input_tokens']:,}", fp, wr, lw,
                     f"{h['no_eviction']:.3f}", f"{h['lru']:.3f}", f"{h['best']:.3f}"])
    print_table(con, cols, rows, title="per round (as given)", box=box.SIMPLE_HEAD,
                more="--json has them")
    con.print("[dim]Predictions from the formula, not measurements; check them with "
              "kvtool replay.[/]")
