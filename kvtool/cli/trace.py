"""``kvtool trace``: statistics of traces, synthetic workloads, format conversion."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click

from kvtool.cli.options import block_size_from, block_size_options
from kvtool.cli.output import emit, json_option, note
from kvtool.errors import UsageError
from kvtool.trace.convert import convert_trace
from kvtool.trace.gen import (
    Form,
    MultiTurn,
    PrefixRepetition,
    RandomPrompts,
    Spec,
    gen_document,
    multi_turn,
    prefix_repetition,
    random_prompts,
)
from kvtool.trace.reader import TraceReader, read_trace
from kvtool.trace.schema import DEFAULT_BLOCK_TOKENS, DEFAULT_WINDOW_MS, FORMATS, WRITABLE
from kvtool.trace.stats import bad_lines, stats_document
from kvtool.trace.writer import Output, write_records
from kvtool.units import format_size

if TYPE_CHECKING:
    from rich.console import Console


def _sink(output: str) -> Output:
    """Where a trace is written: ``-`` is this command's stdout."""
    return sys.stdout.buffer if output == "-" else output


def _reader_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options every trace-reading command shares (same names as ``kvtool replay``)."""
    for opt in reversed([
        click.option("--format", "fmt", type=click.Choice(list(FORMATS)),
                     default="auto", show_default=True,
                     help="Trace format; auto: azure if the first line is the Azure CSV "
                          "header, kvtool if the first record has session, round, "
                          "block_tokens or tokens, bailian (Qwen-Bailian) if it has chat_id, "
                          "parent_chat_id or turn, else Mooncake."),
        click.option("--block-tokens", type=int, metavar="B",
                     help="Tokens per block (default: the trace's block_tokens, else 256 for "
                          "kvtool and Azure, 512 for Mooncake, 16 for Qwen-Bailian traces)."),
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
        from rich.markup import escape

        note(f"[yellow]skipped {len(reader.bad_lines)} bad line(s):[/]")
        for line, message in reader.bad_lines:
            note(escape(f"  {reader.path}:{line}: {message}"), whole=True)


@click.group("trace", epilog="""
\b
Examples:
  kvtool trace stats fixtures/traces/multiturn-4x6.tokens.jsonl
  kvtool trace gen --sessions 16 --rounds 20 --input-tokens 2000 --output-tokens 500 -o t.jsonl
  kvtool trace convert mooncake.jsonl --to kvtool -o t.jsonl
  kvtool trace stats fixtures/traces/azure-conv-head.csv
""")
def command() -> None:
    """Make traces and look inside them (kvtool, Mooncake, Qwen-Bailian JSONL, Azure CSV;
    docs/trace.md)."""


# -- stats ------------------------------------------------------------------------------------
@command.command("stats", short_help="Requests, sessions, tokens, unique blocks, maximum hit ratio",
                 epilog="""
\b
Examples:
  kvtool trace stats fixtures/traces/multiturn-4x6.tokens.jsonl
  kvtool trace stats conversation_trace.jsonl --format mooncake --block-tokens 512 --json
  kvtool trace stats t.jsonl --model deepseek-v4-flash --dtype fp8
  kvtool trace stats fixtures/traces/bailian-sample.jsonl
  kvtool trace stats fixtures/traces/azure-conv-head.csv --no-reuse --json
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
        result = stats_document(reader, path=str(trace), reuse=not no_reuse,
                                block_size=size.to_dict() if size else None)
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


@command.command("gen", short_help="Write a synthetic workload (sessions, random prompts, prefixes)",
                 epilog="""
\b
Examples:
  kvtool trace gen --sessions 4 --rounds 6 --input-tokens 300 --output-tokens 100 \\
      --system-prompt-tokens 600 --block-tokens 64 -o multiturn.jsonl
  kvtool trace gen --sessions 112 --rounds 20 --input-tokens 109030 --output-tokens 5000 \\
      --format hash_ids -o report.jsonl
  kvtool trace gen --random-input-len 100,1000,10000 --num-prompts 16 --iterations 2 \\
      --seed 42 -o bench.jsonl
  kvtool trace gen --random-input-len 1024 --output-tokens 128 --num-prompts 200 \\
      --iterations 1 --request-rate 2 --seed 0 -o poisson.jsonl
  kvtool trace gen --random-input-len 1024 --num-prompts 200 --iterations 1 \\
      --request-rate inf -o burst.jsonl
  kvtool trace gen --prefix-repetition-num-prefixes 10 --prefix-repetition-prefix-len 256 \\
      --prefix-repetition-suffix-len 256 --num-prompts 1000 -o prefix-rep.jsonl
""")
@click.option("-o", "--output", "output", required=True, metavar="FILE",
              help="Where to write the trace (kvtool JSONL; - for stdout).")
@click.option("--sessions", type=int, help="Multi-turn: concurrent sessions C.")
@click.option("--rounds", type=int, help="Multi-turn: rounds R per session.")
@click.option("--input-tokens", type=int, help="Multi-turn: new input tokens N per round.")
@click.option("--output-tokens", type=int,
              help="Answer tokens M per request (multi-turn: required; random and prefix "
                   "repetition: default 128).")
@click.option("--random-input-len", "random_lens", metavar="N[,N…]",
              help="Random prompts of these lengths (vLLM bench's random dataset).")
@click.option("--num-prompts", type=int,
              help="Random: prompts per length (default 1). Prefix repetition: requests "
                   "(default 1000, as vLLM; rounded down to a multiple of the prefixes).")
@click.option("--iterations", type=int, help="Random: times every prompt is sent (default 2).")
@click.option("--random-range-ratio", "range_ratio", type=float,
              help="Random: draw each prompt's and answer's length uniformly within ±this "
                   "fraction (vLLM bench's; default 0: fixed lengths).")
@click.option("--reuse-share", "reuse_share", type=float,
              help="Random: share of the prompts re-sent as they were from iteration 2 (the "
                   "others fresh, same lengths; default 1: all re-sent).")
@click.option("--prefix-repetition-num-prefixes", "rep_prefixes", type=int,
              help="Prefix repetition (vLLM bench's prefix_repetition): distinct prefixes "
                   "(default 10).")
@click.option("--prefix-repetition-prefix-len", "rep_prefix_len", type=int,
              help="Prefix repetition: tokens of each prefix (default 256).")
@click.option("--prefix-repetition-suffix-len", "rep_suffix_len", type=int,
              help="Prefix repetition: random tokens after the prefix (default 256).")
@click.option("--disable-shuffle", is_flag=True,
              help="Prefix repetition: keep requests grouped by prefix (vLLM shuffles).")
@click.option("--system-prompt-tokens", "--random-prefix-len", "system_prompt_tokens", type=int,
              default=0, show_default=True,
              help="Shared prefix (same tokens for every session/prompt; vLLM's "
                   "--random-prefix-len).")
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
@click.option("--request-rate", type=float, metavar="R",
              help="Add timestamps: R requests/s, Poisson as vllm bench serve schedules them "
                   "(seeded); inf: all at t = 0.")
@click.option("--burstiness", type=float,
              help="With --request-rate: gamma shape of the gaps (default 1: Poisson; < 1 "
                   "burstier, inf: constant gaps), as vllm bench serve.")
@json_option
def gen_cmd(output: str, sessions: int | None, rounds: int | None, input_tokens: int | None,
            output_tokens: int | None, random_lens: str | None, num_prompts: int | None,
            iterations: int | None, range_ratio: float | None, reuse_share: float | None,
            rep_prefixes: int | None,
            rep_prefix_len: int | None, rep_suffix_len: int | None, disable_shuffle: bool,
            system_prompt_tokens: int, block_tokens: int, seed: int, form: str,
            interval_ms: float | None, request_rate: float | None,
            burstiness: float | None) -> None:
    """Write a synthetic workload: multi-turn sessions, random prompts, prefix repetition.

    Multi-turn (--sessions/--rounds/--input-tokens/--output-tokens): each round a session
    re-sends its whole history plus N new tokens; the M-token answer joins the next
    round's prefix; a shared system prompt comes first. Random (--random-input-len):
    --num-prompts distinct prompts per length, sent --iterations times, so iteration
    2 onward is 100% reusable (--iterations 1: each prompt once, like vllm bench's random
    dataset). Prefix repetition (--prefix-repetition-*): vllm bench's prefix_repetition
    dataset, requests sharing one of a few prefixes, shuffled. Untimed unless
    --interval-ms or --request-rate. Deterministic for a given --seed.
    """
    spec: Spec
    arrivals: dict[str, Any] = {"interval_ms": interval_ms, "request_rate": request_rate,
                                "burstiness": burstiness if burstiness is not None else 1.0}
    repetition = {"--prefix-repetition-num-prefixes": rep_prefixes,
                  "--prefix-repetition-prefix-len": rep_prefix_len,
                  "--prefix-repetition-suffix-len": rep_suffix_len}
    if disable_shuffle and all(v is None for v in repetition.values()):
        raise UsageError("is for the prefix-repetition workload (give "
                         "--prefix-repetition-num-prefixes, -prefix-len or -suffix-len)",
                         field="--disable-shuffle")
    if any(v is not None for v in repetition.values()):
        _refuse_given((("--sessions", sessions), ("--rounds", rounds),
                       ("--input-tokens", input_tokens), ("--random-input-len", random_lens),
                       ("--iterations", iterations), ("--random-range-ratio", range_ratio),
                       ("--reuse-share", reuse_share)),
                      "is not for the prefix-repetition workload")
        if system_prompt_tokens:
            raise UsageError("is not for the prefix-repetition workload (its prefixes are "
                             "--prefix-repetition-prefix-len)", field="--system-prompt-tokens")
        pspec = PrefixRepetition(
            num_prompts if num_prompts is not None else 1000,
            rep_prefix_len if rep_prefix_len is not None else 256,
            rep_suffix_len if rep_suffix_len is not None else 256,
            rep_prefixes if rep_prefixes is not None else 10,
            output_tokens if output_tokens is not None else 128, not disable_shuffle,
            block_tokens, seed, cast(Form, form), **arrivals)
        spec = pspec
        n = write_records(prefix_repetition(pspec), _sink(output))
    elif random_lens is not None:
        _refuse_given((("--sessions", sessions), ("--rounds", rounds),
                       ("--input-tokens", input_tokens)),
                      "is for the multi-turn workload, not with --random-input-len")
        rspec = RandomPrompts(_lengths(random_lens), num_prompts or 1, iterations or 2,
                              output_tokens if output_tokens is not None else 128,
                              system_prompt_tokens, block_tokens, seed, cast(Form, form),
                              **arrivals, range_ratio=range_ratio or 0.0,
                              reuse_share=1.0 if reuse_share is None else reuse_share)
        spec = rspec
        n = write_records(random_prompts(rspec), _sink(output))
    else:
        _refuse_given((("--num-prompts", num_prompts), ("--iterations", iterations),
                       ("--random-range-ratio", range_ratio), ("--reuse-share", reuse_share)),
                      "is for --random-input-len, not the multi-turn workload")
        for name, value in (("--sessions", sessions), ("--rounds", rounds),
                            ("--input-tokens", input_tokens), ("--output-tokens", output_tokens)):
            if value is None:
                raise UsageError("required for a multi-turn workload (or give "
                                 "--random-input-len for random prompts)", field=name)
        assert sessions is not None and rounds is not None
        assert input_tokens is not None and output_tokens is not None
        mspec = MultiTurn(sessions, rounds, input_tokens, output_tokens, system_prompt_tokens,
                          block_tokens, seed, cast(Form, form),
                          **arrivals)
        spec = mspec
        n = write_records(multi_turn(mspec), _sink(output))
    result = gen_document(spec, output, n)
    if output == "-":
        return
    emit(result, lambda con: con.print(
        f"wrote {n:,} requests ({result['workload']['kind']}, {form}, {block_tokens} tokens/block) "
        f"to {output}"))


def _refuse_given(options: tuple[tuple[str, Any], ...], message: str) -> None:
    """Refuse the first of ``options`` (flag, value) that was given, with ``message``."""
    for name, value in options:
        if value is not None:
            raise UsageError(message, field=name)


# -- convert ----------------------------------------------------------------------------------
@command.command("convert", short_help="Convert between trace formats; tokens become compact hash_ids",
                 epilog="""
\b
Examples:
  kvtool trace convert conversation_trace.jsonl --to kvtool -o conversation.kvtool.jsonl
  kvtool trace convert multiturn.jsonl --to kvtool -o multiturn.hash_ids.jsonl
  kvtool trace convert multiturn.jsonl --to mooncake -o multiturn.mooncake.jsonl
  kvtool trace convert multiturn.jsonl --to bailian -o multiturn.bailian.jsonl
  kvtool trace convert fixtures/traces/bailian-sample.jsonl --to kvtool -o bailian.kvtool.jsonl
  kvtool trace convert fixtures/traces/azure-conv-head.csv --to kvtool -o azure.jsonl
  kvtool trace convert multiturn.jsonl --to azure --interval-ms 500 -o multiturn.csv
""")
@click.argument("trace", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("-o", "--output", "output", required=True, metavar="FILE",
              help="Where to write (- for stdout).")
@click.option("--to", "to", type=click.Choice(list(WRITABLE)), required=True,
              help="Output format (bailian: Qwen-Bailian JSONL; azure: CSV of arrivals and "
                   "lengths only).")
@_reader_options
@click.option("--interval-ms", type=float, default=1.0, show_default=True,
              help="To Mooncake, Qwen-Bailian or Azure from an untimed trace: timestamps this "
                   "far apart, in serve order.")
@json_option
def convert_cmd(trace: str, output: str, to: str, fmt: str, block_tokens: int | None,
                skip_bad: int, window_ms: float, interval_ms: float) -> None:
    """Convert between trace formats; tokens become compact hash_ids.

    The output is in serve order with hash_ids renumbered 0, 1, 2, … by first
    appearance, so it replays exactly like the input. Mooncake lines keep only
    timestamp, input_length, output_length and hash_ids; Qwen-Bailian lines make each
    session a chat_id/parent_chat_id chain; Azure CSV keeps arrivals and lengths only.
    """
    if output != "-" and trace != "-" and Path(output).resolve() == Path(trace).resolve():
        raise UsageError("must differ from the input trace", field="--output")
    with _open(trace, fmt, block_tokens, skip_bad, window_ms) as reader:
        res = convert_trace(reader, _sink(output), to=to, interval_ms=interval_ms)
        _report_bad(reader)
        bad = bad_lines(reader)
    if res.timestamps_added:
        note(f"the trace is untimed: wrote timestamps {interval_ms:g} ms apart in serve order")
    if res.read_back_block_tokens is not None:
        note(f"read it back with --block-tokens {res.read_back_block_tokens} ({to} readers "
             f"assume {DEFAULT_BLOCK_TOKENS[to]})")
    if res.dropped:
        note(f"{to} cannot carry {', '.join(res.dropped)}: dropped")
    result = res.to_document(trace, output, bad)
    if output == "-":
        return
    emit(result, lambda con: con.print(f"wrote {res.requests:,} requests ({to}) to {output}"))
