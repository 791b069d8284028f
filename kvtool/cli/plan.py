"""``kvtool plan``: collapse round, capacity per tier and expected hit ratio of a workload."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import click

from kvtool.cli.options import block_size_from, block_size_options
from kvtool.cli.output import emit, json_option
from kvtool.errors import UsageError
from kvtool.plan.capacity import AnswerKV, Storage, Workload, WritePolicy, plan
from kvtool.units import Capacity, format_size, parse_percent

if TYPE_CHECKING:
    from rich.console import Console

EPILOG = """
\b
Examples:
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


@click.command("plan", epilog=EPILOG)
@click.option("--sessions", "-C", type=int, required=True, help="Concurrent sessions C.")
@click.option("--input-tokens", type=int, required=True,
              help="New input tokens N per session per round.")
@click.option("--output-tokens", type=int, required=True,
              help="Answer tokens M per session per round.")
@click.option("--system-prompt-tokens", type=int, default=0, show_default=True,
              help="Shared system prompt S (stored once).")
@click.option("--rounds", type=int, default=20, show_default=True,
              help="Rounds R to plan for (capacity needed, steady hit ratio).")
@click.option("--dram", required=True, metavar="SIZE",
              help="DRAM tier: bytes (429.5GB), blocks (5859blk), tokens (3000000tok), inf.")
@click.option("--gpu", metavar="SIZE", help="GPU tier (0 or absent: none).")
@click.option("--nvme", metavar="SIZE",
              help="NVMe tier (absent: the with-NVMe scenario uses one sized to the need).")
@click.option("--block-tokens", type=int, default=256, show_default=True,
              help="Tokens per block B.")
@block_size_options
@click.option("--watermark", "watermark", default="100%", show_default=True, metavar="h",
              help="Usable fraction h of each tier (Mooncake evicts at 90%).")
@click.option("--replicas", type=int, default=1, show_default=True, help="Replicas ρ.")
@click.option("--answer-kv", type=click.Choice(["stored", "next-round"]), default="stored",
              show_default=True,
              help="stored: an answer's KV is written in its own round (vLLM offload, "
                   "LMCache); next-round: when the next round re-sends it (kvtool replay).")
@click.option("--write-policy", type=click.Choice(["write-through", "write-back"]),
              default="write-through", show_default=True,
              help="write-through: the largest tier bounds the hierarchy; write-back: the sum.")
@json_option
def command(sessions: int, input_tokens: int, output_tokens: int, system_prompt_tokens: int,
            rounds: int, dram: str, gpu: str | None, nvme: str | None, block_tokens: int,
            model: str | None, dtype: str | None, tp: int | None, block_bytes: int | None,
            watermark: str, replicas: int, answer_kv: str,
            write_policy: str) -> None:
    """Predict when a prefix cache collapses and what each tier must hold.

    Uses the capacity formula (docs/definitions.md) per tensor-parallel rank,
    R = h·M / (ρ·C·b·Δ) with M one rank's tier and b = s/B one rank's bytes per token,
    refined with block rounding and a shared system prompt: the cache first evicts a
    live block in the first round whose footprint exceeds h·M. Prints which terms it
    used, the capacity needed to hold --rounds rounds, and hit ratios with and without
    an NVMe tier.
    """
    workload = Workload(sessions, input_tokens, output_tokens, system_prompt_tokens, rounds,
                        block_tokens, cast(AnswerKV, answer_kv))
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
