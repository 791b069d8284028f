"""``kvtool replay TRACE --cluster FILE``: the serving model's part of the replay command
(a thin shell over :mod:`kvtool.serving.run`; rendering of its report)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from kvtool.cli.output import emit, note, progress
from kvtool.errors import CheckFailed, UsageError, param


def loads_from(concurrency: int | None, request_rate: float | None, speedup: float | None,
               sweep: str | None) -> list[Any]:
    """The load flags as :class:`~kvtool.serving.load.Load` values (at most one kind)."""
    from kvtool.serving.load import Load
    from kvtool.serving.run import parse_sweep

    given = [n for n, v in (("concurrency", concurrency), ("request_rate", request_rate),
                            ("speedup", speedup), ("sweep", sweep)) if v is not None]
    if len(given) > 1:
        raise UsageError(f"{param(given[0])} and {param(given[1])} are two loads: give one",
                         field=given[1])
    if sweep is not None:
        return parse_sweep(sweep)
    if concurrency is not None:
        return [Load("concurrency", float(concurrency))]
    if request_rate is not None:
        return [Load("request-rate", request_rate)]
    if speedup is not None:
        return [Load("timestamps", speedup)]
    return []


def note_fanout(fanout: Any, points: int) -> None:
    """Say where ``points`` independent runs go (once the input has been read)."""
    if fanout is not None and fanout.kind != "serial" and points > 1:
        where = (f"Ray cluster {fanout.ray_address}" if fanout.kind == "ray"
                 else f"{fanout.workers} local processes")
        note(f"independent runs side by side on {where}")


def run(*, trace: str, clusters: tuple[str, ...], simulate: bool, fmt: str,
        block_tokens: int | None, skip_bad: int, loads: list[Any], seed: int,
        csv_path: str | None, plot_path: str | None, nvme_place: str | None = None,
        read_qd: int = 32, credentials: Any = None,
        scalars: dict[str, float] | None = None, fanout: Any = None,
        faults: tuple[str, ...] = (), exact_steps: bool = False) -> None:
    from kvtool.serving.run import ServingSettings, run_serving, write_csv, write_plot

    settings = ServingSettings(trace=trace, clusters=clusters, loads=loads, fmt=fmt,
                               block_tokens=block_tokens, skip_bad=skip_bad, seed=seed,
                               scalars=dict(scalars or {}), exact_steps=exact_steps)
    from kvtool.replay.backend import data_backend

    backend, state = data_backend(clusters[0], simulate=simulate, seed=seed, faults=faults,
                                  nvme_place=nvme_place, read_qd=read_qd,
                                  credentials=credentials,
                                  on_place=lambda where: note(f"data mode: {where}"))
    if state is not None:
        note(f"data mode on cluster {state.name}: engines as Ray actors on their nodes "
             f"(Ray at {state.ray_address})")
    def on_setup(head: dict[str, Any]) -> None:
        if backend is None:
            note_fanout(fanout, len(head["clusters"]) * len(head["loads"]))
        for line in describe(head):
            note(line)

    # Ray's driver prints its notices (a node marked dead…) on sys.stdout: while Ray may
    # run, they go to stderr, so that stdout holds the report alone (--json)
    with progress("serving model", None, unit="requests") as advance, \
            contextlib.redirect_stdout(sys.stderr):
        doc = run_serving(settings, progress=advance, on_setup=on_setup, backend=backend,
                          fanout=fanout)
    if csv_path:
        write_csv(doc, csv_path)
    if plot_path:
        write_plot(doc, plot_path, title=f"kvtool replay {Path(trace).name} (simulated)")
    emit(doc, lambda con: render(con, doc))
    # Corrupt blocks are a failed check; so are lost ones, unless a fault was injected
    # (then they are what it cost: recomputed, counted, never served).
    if any(r.get("data", {}).get("corrupt_blocks") or
           (r.get("data", {}).get("lost_blocks") and not r["data"].get("faults"))
           for r in doc["runs"]):
        raise CheckFailed("corrupt or lost blocks were found (never served); see the report")


def describe(head: dict[str, Any]) -> list[str]:
    lines = [f"trace {head['trace']}: {head['requests']:,} requests, "
             f"{head['block_tokens']} tokens/block"]
    for c in head["clusters"]:
        lines.append(f"cluster {c['name']}: " + ", ".join(
            f"{e['count']}× {e['model']} on {e['tp']}× {e['gpu']} ({e['role']}, "
            f"{e['num_gpu_blocks']:,} blocks)" for e in c["engine_groups"])
            + f"; router {c['router']}")
    return lines


def _ms(x: float) -> str:
    return f"{x / 1000:.2f} s" if x >= 1000 else f"{x:.1f} ms"


def _short(load: dict[str, Any]) -> str:
    """A load in a few characters: C=16 (users), R=2/s (Poisson), T×1 (timestamps)."""
    kind, value = load["kind"], load["value"]
    if kind == "concurrency":
        return f"C={value}"
    if kind == "request-rate":
        return f"R={value}/s" if value != "inf" else "R=inf"
    return f"T×{value:g}"


def render(con: Any, doc: dict[str, Any]) -> None:
    from rich.table import Table

    runs = doc["runs"]
    con.print(f"[bold]kvtool replay[/] {doc['trace']} · serving model · "
              f"{doc['requests']:,} requests")
    t = Table(title="serving (simulated)", title_justify="left")
    for col in ("run", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                "hit"):
        t.add_column(col, justify="right" if col != "run" else "left")
    for r in runs:
        s = r["serving"]
        t.add_row(f"{r['cluster']} {_short(r['load'])}", f"{s['request_throughput']:.2f}",
                  f"{s['output_throughput']:,.0f}", _ms(s["median_ttft_ms"]),
                  _ms(s["p99_ttft_ms"]), _ms(s["median_tpot_ms"]),
                  f"{100 * r['cache']['token_hit_ratio']:.1f}%")
    con.print(t)
    if len(runs) == 1:
        r = runs[0]
        e = Table(title="engines", title_justify="left")
        for col in ("engine", "busy", "batch", "preempt", "GPU hit", "ext hit"):
            e.add_column(col, justify="right" if col != "engine" else "left")
        for eng in r["engines"]:
            q = eng["gpu_prefix_query_tokens"]
            e.add_row(eng["name"], f"{100 * eng['busy_fraction']:.0f}%",
                      f"{eng['mean_batch_seqs']:.1f}", f"{eng['preemptions']:,}",
                      f"{100 * eng['gpu_prefix_hit_tokens'] / q:.1f}%" if q else "–",
                      f"{100 * eng['external_hit_tokens'] / q:.1f}%" if q else "–")
        con.print(e)
        links = [(n, d, v) for n, dirs in r["links"].items() for d, v in dirs.items()
                 if v["bytes"]]
        if links:
            lt = Table(title="links", title_justify="left")
            for col in ("link", "dir", "GB", "busy"):
                lt.add_column(col, justify="right" if col not in ("link", "dir") else "left")
            for n, d, v in links:
                lt.add_row(n, d, f"{v['bytes'] / 1e9:,.1f}", f"{100 * v['busy_fraction']:.0f}%")
            con.print(lt)
        s = r["serving"]
        con.print(f"completed {s['completed']:,} · failed {s['failed']:,} · duration "
                  f"{s['duration']:,.1f} s · queue mean {_ms(s['mean_queue_ms'])}")
    for r in runs:
        d = r.get("data")
        if not d:
            continue
        colour = "red" if d["corrupt_blocks"] or d["lost_blocks"] else "green"
        con.print(f"[{colour}]data mode ({r['label']}): verified {d['verified_blocks']:,} "
                  f"blocks · corrupt {d['corrupt_blocks']:,} · lost {d['lost_blocks']:,}[/]")
        for name, c in d["tiers"].items():
            con.print(f"  {name}: wrote {c['blocks_written']:,} blocks "
                      f"({c['bytes_written'] / 1e6:,.1f} MB), read {c['blocks_read']:,} "
                      f"({c['bytes_read'] / 1e6:,.1f} MB), evicted {c['evicted']:,} (measured)")
        if "cross_engine_hits" in d:
            by = ", ".join(f"{k} {v:,}" for k, v in d["cross_engine_hits_by_tier"].items())
            con.print(f"  cross-engine hits {d['cross_engine_hits']:,}"
                      + (f" ({by})" if by else "") + " · verified like every hit")
        for f in d.get("faults", []):
            con.print(f"  [yellow]fault[/] {f['kind']} {f['who']} at {f['fired_at_s']:.3f} s "
                      f"(simulated; asked for {f['at_s']:g} s; {f['wall_s']:.1f} s into the "
                      f"run's wall time): {f['effect']}")
        for p in d["problems"][:10]:
            if "key" not in p:
                con.print(f"  [red]{p['kind']}[/] {p['target']}: {p['error']}")
                continue
            con.print(f"  [red]{p['kind']}[/] block {p['key']:#x} in {p['tier']} "
                      f"(engine {p['engine']}): never served")
    from kvtool.serving.overload import line as overload_line

    for r in runs:
        said = overload_line(r.get("overload"))
        if said:
            con.print(f"[bold yellow]{r['label']}: {said}[/]")
    con.print("[dim]C: users (closed loop), R: requests/s (Poisson), T: the trace's "
              "timestamps. All times are simulated (the engines' step times, flows over "
              "links; docs/serving.md), not measured.[/]")
