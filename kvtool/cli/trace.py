"""``kvtool trace``: statistics of traces, synthetic workloads, format conversion."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click

from kvtool.cli.options import block_size_from, block_size_options
from kvtool.cli.output import emit, json_option, note
from kvtool.errors import UsageError
from kvtool.trace.convert import convert_trace
from kvtool.trace.gen import Form, MultiTurn, RandomPrompts, multi_turn, random_prompts
from kvtool.trace.reader import TraceReader, read_trace
from kvtool.trace.schema import DEFAULT_WINDOW_MS
from kvtool.trace.stats import trace_stats
from kvtool.trace.writer import write_records
from kvtool.units import format_size

if TYPE_CHECKING:
    from rich.console import Console


def _reader_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options every trace-reading command shares (same names as ``kvtool replay``)."""
    for opt in reversed([
        click.option("--format", "fmt", type=click.Choice(["auto", "kvtool", "mooncake"]),
                     default="auto", show_default=True,
                     help="Trace format; auto: kvtool if the first line has session, round, "
                          "block_tokens or tokens, else Mooncake."),
        click.option("--block-tokens", type=int, metavar="B",
                     help="Tokens per block (default: the trace's block_tokens, else 256 for "
                          "kvtool and 512 for Mooncake traces)."),
        click.option("--skip-bad", type=int, default=0, metavar="N", show_default=True,
                     help="Skip up to N bad lines (and list them) instead of failing."),
        click.option("--window-ms", type=float, default=DEFAULT_WINDOW_MS, show_default=True,
                     help="Rows of the per-round table for timed traces without rounds "
                          "(Mooncake): time windows of this many ms."),
    ]):
        f = opt(f)
    return f


def _open(trace: str, fmt: str, block_tokens: int | None, skip_bad: int,
          window_ms: float) -> TraceReader:
    return read_trace(trace, fmt=fmt, block_tokens=block_tokens, skip_bad=skip_bad,
                      window_ms=window_ms)


def _report_bad(reader: TraceReader) -> None:
    if reader.bad_lines:
        note(f"[yellow]skipped {len(reader.bad_lines)} bad line(s) of {reader.path}:[/]")
        for line, message in reader.bad_lines:
            note(f"  {reader.path}:{line}: {message}")


@click.group("trace", epilog="""
\b
Examples:
  kvtool trace stats fixtures/traces/multiturn-4x6.tokens.jsonl
  kvtool trace gen --sessions 16 --rounds 20 --input-tokens 2000 --output-tokens 500 -o t.jsonl
  kvtool trace convert mooncake.jsonl --to kvtool -o t.jsonl
""")
def command() -> None:
    """Make traces and look inside them (kvtool and Mooncake JSONL; docs/trace.md)."""


# -- stats ------------------------------------------------------------------------------------
@command.command("stats", epilog="""
\b
Examples:
  kvtool trace stats fixtures/traces/multiturn-4x6.tokens.jsonl
  kvtool trace stats conversation_trace.jsonl --format mooncake --block-tokens 512 --json
  kvtool trace stats t.jsonl --model deepseek-v4-flash --dtype fp8
""")
@click.argument("trace", type=click.Path(dir_okay=False, allow_dash=True))
@_reader_options
@block_size_options
@click.option("--no-reuse", is_flag=True, help="Skip the reuse-distance histogram (faster).")
@json_option
def stats_cmd(trace: str, fmt: str, block_tokens: int | None, skip_bad: int, window_ms: float,
              model: str | None, dtype: str | None, tp: int | None, block_bytes: int | None,
              no_reuse: bool) -> None:
    """Requests, sessions, tokens, unique blocks, the theoretical maximum hit ratio.

    The maximum is the token hit ratio of an infinite cache (docs/definitions.md): each request hits
    its leading blocks seen before, min(k·B, input_length) tokens. The reuse distance of a
    block is the number of distinct other blocks used since its previous use: an LRU cache
    of more than that many blocks would hit it.
    """
    with _open(trace, fmt, block_tokens, skip_bad, window_ms) as reader:
        size = block_size_from(model, dtype, tp, block_bytes, reader.block_tokens)
        result = trace_stats(reader, reuse=not no_reuse,
                             block_bytes=size.block_bytes if size else None)
        result = {"schema": "kvtool.trace.stats/1", "trace": str(trace),
                  "format": reader.format, "timed": reader.timed,
                  "window_ms": reader.window_ms,
                  "block_size": size.to_dict() if size else None,
                  **result, "bad_lines": [{"line": n, "message": m} for n, m in reader.bad_lines]}
        _report_bad(reader)
    emit(result, lambda con: _render_stats(con, result))


def _render_stats(con: Console, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    summary = Table(title=f"trace {r['trace']} ({r['format']}, {r['block_tokens']} tokens/block)",
                    box=box.SIMPLE, show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    il = r["input_length"]
    rows: list[tuple[str, str]] = [
        ("requests", f"{r['requests']:,}"),
        ("sessions", f"{r['sessions']:,}" if r["sessions"] else "— (no sessions)"),
        ("rounds", f"{r['rounds']:,}" if r["rounds"] else "— (no rounds)"),
        ("duration", f"{r['duration_ms'] / 1000:,.1f} s" if r["timed"] else "— (untimed)"),
        ("input tokens", f"{r['input_tokens']:,}"),
        ("output tokens", f"{r['output_tokens']:,}"),
        ("input length mean / p50 / p99 / max",
         f"{il['mean']:,.0f} / {il['p50']:,} / {il['p99']:,} / {il['max']:,}"),
        ("block accesses", f"{r['block_accesses']:,}"),
        ("unique blocks", f"{r['unique_blocks']:,}"),
    ]
    if r["unique_bytes"] is not None:
        tp = r["block_size"]["tp"]
        rows.append(("unique blocks' footprint" + (f" (one rank of {tp})" if tp > 1 else ""),
                     format_size(r["unique_bytes"])))
    rows += [
        ("max token hit ratio (infinite cache)", f"{r['max_token_hit_ratio']:.4f}"),
        ("max block hit ratio", f"{r['max_block_hit_ratio']:.4f}"),
    ]
    for k, v in rows:
        summary.add_row(k, v)
    con.print(summary)

    per = r["per_round"]
    if len(per) > 1:
        unit = "round" if r["rounds"] else "window"
        title = ("per round" if r["rounds"] else f"per {r['window_ms'] / 1000:g} s window")
        t = Table(title=f"{title} (infinite cache)", box=box.SIMPLE_HEAD)
        for col in (unit, "requests", "input tokens", "max hit tokens", "max hit ratio",
                    "new blocks"):
            t.add_column(col, justify="right")
        shown = per if len(per) <= 40 else [*per[:20], None, *per[-20:]]
        for row in shown:
            if row is None:
                t.add_row("⋮", "", "", "", "", "")
                continue
            t.add_row(str(row["round"]), f"{row['requests']:,}", f"{row['input_tokens']:,}",
                      f"{row['max_hit_tokens']:,}", f"{row['max_token_hit_ratio']:.3f}",
                      f"{row['new_blocks']:,}")
        con.print(t)

    reuse = r["reuse_distance"]
    if reuse:
        t = Table(title=f"reuse distance (distinct blocks between uses; {reuse['cold']:,} cold)",
                  box=box.SIMPLE_HEAD)
        t.add_column("blocks", justify="right")
        t.add_column("reuses", justify="right")
        t.add_column("", justify="left")
        peak = max((b["count"] for b in reuse["buckets"]), default=0) or 1
        for b in reuse["buckets"]:
            if not b["count"]:
                continue
            label = f"{b['min']:,}" if b["min"] == b["max"] else f"{b['min']:,}–{b['max']:,}"
            t.add_row(label, f"{b['count']:,}", "█" * max(1, round(30 * b["count"] / peak)))
        con.print(t)


# -- gen --------------------------------------------------------------------------------------
def _lengths(text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise UsageError(f"expected token counts like 100,1000,10000, got {text!r}",
                         field="--random-input-len") from None


@command.command("gen", epilog="""
\b
Examples:
  kvtool trace gen --sessions 4 --rounds 6 --input-tokens 300 --output-tokens 100 \\
      --system-prompt-tokens 600 --block-tokens 64 -o multiturn.jsonl
  kvtool trace gen --sessions 112 --rounds 20 --input-tokens 109030 --output-tokens 5000 \\
      --format hash_ids -o report.jsonl
  kvtool trace gen --random-input-len 100,1000,10000 --num-prompts 16 --iterations 2 \\
      --seed 42 -o bench.jsonl
""")
@click.option("-o", "--output", "output", required=True, metavar="FILE",
              help="Where to write the trace (kvtool JSONL; - for stdout).")
@click.option("--sessions", type=int, help="Multi-turn: concurrent sessions C.")
@click.option("--rounds", type=int, help="Multi-turn: rounds R per session.")
@click.option("--input-tokens", type=int, help="Multi-turn: new input tokens N per round.")
@click.option("--output-tokens", type=int,
              help="Answer tokens M per request (multi-turn: required; random: default 128).")
@click.option("--random-input-len", "random_lens", metavar="N[,N…]",
              help="Random prompts of these lengths (vLLM bench's random dataset).")
@click.option("--num-prompts", type=int, help="Random: prompts per length (default 1).")
@click.option("--iterations", type=int, help="Random: times every prompt is sent (default 2).")
@click.option("--system-prompt-tokens", type=int, default=0, show_default=True,
              help="Shared prefix (same tokens for every session/prompt).")
@click.option("--block-tokens", type=int, default=256, show_default=True,
              help="Tokens per block, written on every line.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
@click.option("--format", "form", type=click.Choice(["tokens", "hash_ids"]), default="tokens",
              show_default=True,
              help="tokens: token ids (hashed when read); hash_ids: compact block ids (small "
                   "files for big workloads; replays identically).")
@click.option("--interval-ms", type=float,
              help="Add timestamps this many ms apart (default: untimed, served round by "
                   "round).")
@json_option
def gen_cmd(output: str, sessions: int | None, rounds: int | None, input_tokens: int | None,
            output_tokens: int | None, random_lens: str | None, num_prompts: int | None,
            iterations: int | None, system_prompt_tokens: int, block_tokens: int, seed: int,
            form: str, interval_ms: float | None) -> None:
    """Write a synthetic workload: multi-turn sessions, or random prompts re-sent.

    Multi-turn (--sessions/--rounds/--input-tokens/--output-tokens): each round a session
    re-sends its whole history plus N new tokens; the M-token answer joins the next
    round's prefix; a shared system prompt comes first. Random (--random-input-len):
    --num-prompts prompts per length, re-sent unchanged --iterations times, so iteration
    2 onward is 100% reusable. Deterministic for a given --seed.
    """
    workload: dict[str, Any]
    if random_lens is not None:
        for name, value in (("--sessions", sessions), ("--rounds", rounds),
                            ("--input-tokens", input_tokens)):
            if value is not None:
                raise UsageError("is for the multi-turn workload, not with --random-input-len",
                                 field=name)
        rspec = RandomPrompts(_lengths(random_lens), num_prompts or 1, iterations or 2,
                              output_tokens if output_tokens is not None else 128,
                              system_prompt_tokens, block_tokens, seed, cast(Form, form),
                              interval_ms)
        n = write_records(random_prompts(rspec), output)
        workload = {"kind": "random", "input_lengths": list(rspec.input_lengths),
                    "num_prompts": rspec.num_prompts, "iterations": rspec.iterations,
                    "output_tokens": rspec.output_tokens}
    else:
        for name, value in (("--num-prompts", num_prompts), ("--iterations", iterations)):
            if value is not None:
                raise UsageError("is for --random-input-len, not the multi-turn workload",
                                 field=name)
        for name, value in (("--sessions", sessions), ("--rounds", rounds),
                            ("--input-tokens", input_tokens), ("--output-tokens", output_tokens)):
            if value is None:
                raise UsageError("required for a multi-turn workload (or give "
                                 "--random-input-len for random prompts)", field=name)
        assert sessions is not None and rounds is not None
        assert input_tokens is not None and output_tokens is not None
        mspec = MultiTurn(sessions, rounds, input_tokens, output_tokens, system_prompt_tokens,
                          block_tokens, seed, cast(Form, form), interval_ms)
        n = write_records(multi_turn(mspec), output)
        workload = {"kind": "multi-turn", "sessions": sessions, "rounds": rounds,
                    "input_tokens": input_tokens, "output_tokens": output_tokens}
    result = {"schema": "kvtool.trace.gen/1", "output": output, "requests": n, "form": form,
              "block_tokens": block_tokens,
              "system_prompt_tokens": system_prompt_tokens, "seed": seed,
              "timed": interval_ms is not None, "workload": workload}
    if output == "-":
        return
    emit(result, lambda con: con.print(
        f"wrote {n:,} requests ({workload['kind']}, {form}, {block_tokens} tokens/block) "
        f"to {output}"))


# -- convert ----------------------------------------------------------------------------------
@command.command("convert", epilog="""
\b
Examples:
  kvtool trace convert conversation_trace.jsonl --to kvtool -o conversation.kvtool.jsonl
  kvtool trace convert multiturn.jsonl --to kvtool -o multiturn.hash_ids.jsonl
  kvtool trace convert multiturn.jsonl --to mooncake -o multiturn.mooncake.jsonl
""")
@click.argument("trace", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("-o", "--output", "output", required=True, metavar="FILE",
              help="Where to write (- for stdout).")
@click.option("--to", "to", type=click.Choice(["kvtool", "mooncake"]), required=True,
              help="Output format.")
@_reader_options
@click.option("--interval-ms", type=float, default=1.0, show_default=True,
              help="To Mooncake from an untimed trace: timestamps this far apart, in serve "
                   "order.")
@json_option
def convert_cmd(trace: str, output: str, to: str, fmt: str, block_tokens: int | None,
                skip_bad: int, window_ms: float, interval_ms: float) -> None:
    """Convert between kvtool and Mooncake JSONL; tokens become compact hash_ids.

    The output is in serve order with hash_ids renumbered 0, 1, 2, … by first
    appearance, so it replays exactly like the input. Mooncake lines keep only
    timestamp, input_length, output_length and hash_ids.
    """
    if output != "-" and trace != "-" and Path(output).resolve() == Path(trace).resolve():
        raise UsageError("must differ from the input trace", field="--output")
    with _open(trace, fmt, block_tokens, skip_bad, window_ms) as reader:
        res = convert_trace(reader, output, to=to, interval_ms=interval_ms)
        _report_bad(reader)
        bad = [{"line": n, "message": m} for n, m in reader.bad_lines]
    if res.timestamps_added:
        note(f"the trace is untimed: wrote timestamps {interval_ms:g} ms apart in serve order")
    if res.read_back_block_tokens is not None:
        note(f"read it back with --block-tokens {res.read_back_block_tokens} (Mooncake readers "
             "assume 512)")
    result = {"schema": "kvtool.trace.convert/1", "input": trace, "output": output, "to": to,
              "requests": res.requests,
              "block_tokens": res.block_tokens, "timestamps_added": res.timestamps_added,
              "read_back_block_tokens": res.read_back_block_tokens, "bad_lines": bad}
    if output == "-":
        return
    emit(result, lambda con: con.print(f"wrote {res.requests:,} requests ({to}) to {output}"))
