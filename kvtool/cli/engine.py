"""``kvtool replay TRACE --engine vllm``: the real-engine part of the replay command (a thin
shell over :mod:`kvtool.integrations.engine_replay`; rendering of its report)."""

from __future__ import annotations

from typing import Any

from kvtool.cli.output import emit, note, progress
from kvtool.errors import CheckFailed


def run(settings: Any, csv_path: str | None) -> None:
    from kvtool.integrations.engine_replay import prepare

    job = prepare(settings, on_event=note)
    setup = job.setup()
    note(f"engine {setup['engine']} · model {setup['model']}"
         + (" (kvtool's tiny random-weight Llama: not a real model)"
            if setup["not_a_real_model"] else "")
         + f" · KV cache {setup['kv_cache']} · {job.block_tokens} tokens/block · "
         + job.load.label)
    if job.spec is not None:
        note("kvtool tiers: " + ", ".join(f"{k} {v}" for k, v in job.spec.to_dict().items()
                                          if k in ("dram", "nvme", "policy", "tiers")))
    passes = 2 if settings.check_outputs else 1
    with progress("vllm engine", job.requests * passes, unit="requests") as advance:
        doc = job.run(progress=advance)
    if csv_path:
        write_csv(doc, csv_path)
    emit(doc, lambda con: render(con, doc))
    check = doc.get("check_outputs")
    if check is not None and not check["ok"]:
        raise CheckFailed(f"{len(check['differ'])} of {check['requests']} requests gave other "
                          "tokens with the connector than without it (first: request "
                          f"{check['differ'][0]})")
    if doc.get("corrupt_blocks") or doc.get("lost_blocks"):
        raise CheckFailed("corrupt or lost blocks were found (recomputed by the engine, never "
                          "served); see the report")


def write_csv(doc: dict[str, Any], path: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "requests", "input_tokens", "hit_tokens", "token_hit_ratio"])
        for r in doc["rounds"]:
            w.writerow([r["round"], r["requests"], r["input_tokens"], r["hit_tokens"],
                        f"{r['token_hit_ratio']:.6f}"])


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _ms(x: float) -> str:
    return f"{x / 1000:.2f} s" if x >= 1000 else f"{x:.1f} ms"


def render(con: Any, doc: dict[str, Any]) -> None:
    from kvtool.cli.output import Column, print_table
    from kvtool.units import format_size

    e = doc["engine"]
    con.print(f"[bold]kvtool replay[/] {doc['trace']} · vLLM {e['version']} engine "
              f"({e['num_gpu_blocks']:,} KV blocks of {e['block_size']} tokens)")
    rows: list[list[str] | None] = [
        [str(r["round"]), str(r["requests"]), f"{r['input_tokens']:,}",
         f"{r['hit_tokens']:,}", _pct(r["token_hit_ratio"])] for r in doc["rounds"]]
    rows.append(None)
    rows.append(["total", str(doc["requests"]), f"{doc['input_tokens']:,}",
                 f"{doc['hit_tokens']['total']:,}", _pct(doc["token_hit_ratio"])])
    print_table(con, [Column("round", rank=0), Column("reqs", rank=2),
                      Column("input\ntokens", rank=1), Column("cached\ntokens", rank=1),
                      Column("hit\nratio", rank=0)], rows,
                title="prompt tokens the engine did not compute (measured)")
    hits = doc["hit_tokens"]
    con.print("hit tokens by tier: " + " · ".join(
        f"{k} {v:,}" for k, v in hits.items() if k != "total")
        + " (vLLM's counters) · collapse round "
        + (str(doc["cliff_round"]) if doc["cliff_round"] is not None else "none"))
    conn = doc.get("connector")
    if conn is not None:
        trs: list[list[str] | None] = []
        for t in conn["tiers"]:
            trs.append([t["name"], t["backend"], f"{t['hit_blocks']:,}",
                        format_size(t["loaded_bytes"], binary=False), f"{t['stored_blocks']:,}",
                        format_size(t["stored_bytes"], binary=False),
                        f"{t['reopened_blocks']:,}"])
        print_table(con, [Column("tier", justify="left"), Column("backend", rank=3),
                          Column("loaded\nblocks"), Column("loaded", rank=2),
                          Column("stored\nblocks"), Column("stored", rank=2),
                          Column("found at\nstart", rank=3)], trs,
                    title="kvtool tiers under the engine (connector)")
        colour = "red" if conn["corrupt_blocks"] or conn["lost_blocks"] else "green"
        con.print(f"[{colour}]verified {conn['verified_blocks']:,} blocks · corrupt "
                  f"{conn['corrupt_blocks']:,} · lost {conn['lost_blocks']:,}[/] (CRC32C on "
                  "every load; a bad block is recomputed, never served)")
    s = doc["serving"]
    con.print(f"measured: {s['completed']} requests in {s['duration']:.2f} s · "
              f"{s['request_throughput']:.2f} req/s · {s['output_throughput']:.0f} output "
              f"tok/s · TTFT p50 {_ms(s['median_ttft_ms'])} p99 {_ms(s['p99_ttft_ms'])} · "
              f"TPOT p50 {_ms(s['median_tpot_ms'])}")
    check = doc.get("check_outputs")
    if check is not None:
        ref = doc["reference"]
        colour = "green" if check["ok"] else "red"
        con.print(f"[{colour}]check: {check['identical']} of {check['requests']} requests "
                  f"gave identical greedy tokens without the connector[/] (its hit ratio "
                  f"{_pct(ref['token_hit_ratio'])}, TTFT p50 "
                  f"{_ms(ref['serving']['median_ttft_ms'])})")
    if e["model"] and doc["setup"]["not_a_real_model"]:
        con.print("[dim]Model: kvtool's random-weight Llama (not a real model; "
                  "--model-path DIR for yours). Times are wall-clock on this machine.[/]")
