"""``kvtool audit``: KV object sizes vs 512 B / 4 KiB alignment, before any I/O runs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvtool.align.audit import AuditReport, audit
from kvtool.align.layout import read_extents
from kvtool.align.probe import DeviceLimits, probe_device
from kvtool.cli.options import block_size_options
from kvtool.cli.output import emit, json_option
from kvtool.errors import CheckFailed, UsageError
from kvtool.geometry import KVGeometry, Layout, ObjectSize
from kvtool.geometry.blocksize import resolve_geometry
from kvtool.units import format_size, parse_size

if TYPE_CHECKING:
    from rich.console import Console

EPILOG = """
\b
Examples:
  kvtool audit --model deepseek-v4-flash --dtype fp8 --lba 512
  kvtool audit --object-bytes 1002240 --lba 512 --lba 4096 --json
  kvtool audit --model llama-3-70b --tp 4 --layout layer
  kvtool audit --model deepseek-v3 --dtype fp8_ds_mla --device /dev/loop3
  kvtool audit --object-bytes 1002240 --layout packed:offset=0,count=1000 --strict
  kvtool audit --geometry fixtures/models/custom-gqa.toml --layout extents.csv

\b
--layout takes, and may be repeated with:
  block | layer                one object per block (all layers), or one per layer
  packed:offset=X,count=N[,size=S][,stride=T][,align=A]
                               N objects back to back from X (size defaults to the object)
  FILE.json | FILE.csv         extents: offset,length[,buffer] (see docs/audit.md)
"""


def _positive_size(text: str, field: str) -> int:
    value = parse_size(text.strip(), field=field) if not text.strip().startswith("-") else None
    if value is None:
        raise UsageError(f"must be a positive size, got {text!r}", field=field)
    if value <= 0:
        raise UsageError(f"must be a positive size, got {text!r}", field=field)
    return value


@click.command("audit", epilog=EPILOG)
@block_size_options
@click.option("--block-tokens", type=int, default=256, show_default=True,
              help="Tokens per block (chunk).")
@click.option("--geometry", "geometry_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Custom model geometry from a TOML file (docs/geometry.md).")
@click.option("--layers", type=int, help="Custom model: number of layers.")
@click.option("--kv-heads", type=int, help="Custom MHA/GQA model: KV heads.")
@click.option("--head-dim", type=int, help="Custom MHA/GQA model: head dimension.")
@click.option("--kv-lora-rank", type=int, help="Custom MLA model: latent (kv_lora_rank) dim.")
@click.option("--rope-dim", "qk_rope_head_dim", type=int, help="Custom MLA model: qk_rope_head_dim.")
@click.option("--lba", "lbas", multiple=True, metavar="SIZE",
              help="LBA size to audit against (repeatable). Default: 512 and 4096, or the "
                   "device's when --device is given.")
@click.option("--mem-align", metavar="SIZE",
              help="Buffer-address alignment (default: the device's dio_mem_align, else 4096).")
@click.option("--device", type=click.Path(path_type=Path),
              help="Probe a block device or file for its real limits and audit against them.")
@click.option("--layout", "layouts", multiple=True, metavar="SPEC",
              help="block|layer (object layout), a packed:... rule, or an extents file. "
                   "Repeatable.")
@click.option("--strict", is_flag=True, help="Exit 1 when any check fails (padding needed, "
              "misaligned or overlapping extent).")
@json_option
def command(model: str | None, dtype: str | None, tp: int | None, block_bytes: int | None,
            block_tokens: int, geometry_file: Path | None, layers: int | None,
            kv_heads: int | None, head_dim: int | None, kv_lora_rank: int | None,
            qk_rope_head_dim: int | None, lbas: tuple[str, ...], mem_align: str | None,
            device: Path | None, layouts: tuple[str, ...], strict: bool) -> None:
    """Audit KV object sizes and placements against 512 B / 4 KiB alignment.

    Computes the KV object size from a model's geometry (or takes --block-bytes), its
    residue modulo each LBA size, the padded size and LBA count, the padding waste, and
    the strategy: write as is, or pad and bounce through an aligned scratch buffer
    (copying back only the original bytes on read). --device probes a real block device
    or file (BLKSSZGET, BLKPBSZGET, BLKGETSIZE64, statx STATX_DIOALIGN); --layout audits
    a placement and names the first misaligned extent.
    """
    object_layout: Layout = "block"
    rules: list[str] = []
    extent_lists = []
    for spec in layouts:
        s = spec.strip()
        if s.lower() == "block":
            object_layout = "block"
        elif s.lower() == "layer":
            object_layout = "layer"
        elif s.lower().startswith("packed:"):
            rules.append(s)
        else:
            extent_lists.append((s, read_extents(s)))

    if block_bytes is not None and object_layout == "layer":
        raise UsageError("--layout layer splits a model's block into per-layer objects; give "
                         "--model or --geometry, not --block-bytes", field="--layout")
    geometry = resolve_geometry(
        model=model, geometry_file=geometry_file, layers=layers, kv_heads=kv_heads,
        head_dim=head_dim, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
        dtype=dtype, tp=tp, block_tokens=block_tokens, block_bytes=block_bytes)
    objects: list[ObjectSize] = (
        [ObjectSize("object", block_bytes, 1)] if block_bytes is not None
        else list(geometry.object_sizes(object_layout)) if geometry is not None else [])
    object_layout_out = object_layout if geometry is not None else None

    if not objects and device is None and not rules and not extent_lists:
        raise UsageError("nothing to audit: give --model, --block-bytes, --geometry, "
                         "--device or --layout", field="--model")
    limits = probe_device(device) if device is not None else None
    lba_values = [_positive_size(v, "--lba") for v in lbas]
    mem = _positive_size(mem_align, "--mem-align") if mem_align is not None else None
    report = audit(objects, lbas=lba_values, device=limits, mem_align=mem, rules=rules,
                   extent_lists=extent_lists, geometry=geometry, object_layout=object_layout_out)
    emit(report.to_dict(), lambda con: render(con, report))
    if strict and not report.ok:
        raise CheckFailed(f"audit failed: {len(report.failures)} check(s); first: "
                          f"{report.failures[0]}")


def _n(v: int) -> str:
    return f"{v:,}"


def render(con: Console, report: AuditReport) -> None:
    """The human view of an :class:`AuditReport`."""
    if report.geometry is not None:
        _render_geometry(con, report.geometry)
    if report.device is not None:
        _render_device(con, report.device)
    if report.checks:
        _render_objects(con, report)
    if report.layouts:
        _render_placements(con, report)
    if report.ok:
        con.print("[green]OK[/]: every size and extent is aligned")
    else:
        con.print(f"[yellow]{len(report.failures)} check(s) need attention[/]"
                  " (exit 1 with --strict)")


def _render_geometry(con: Console, g: KVGeometry) -> None:
    """The model's KV geometry: bytes per token and per block, how TP shards the block."""
    from rich.markup import escape

    dtype = g.dtype + (f" ({g.record})" if g.record else "")
    bpt = g.bytes_per_token
    bpt_s = _n(int(bpt)) if bpt.is_integer() else f"{bpt:,.2f}"
    con.print(f"[bold]{escape(g.model)}[/] {dtype}, {g.attention.upper()}, {g.layers} layers, "
              f"{g.block_tokens} tokens/block, TP {g.tp}")
    heads = g.kv_heads or 1
    if g.attention == "mla":
        sharding = "full copy on every rank"
    elif g.tp <= heads:
        sharding = f"{heads // g.tp} of {heads} KV heads per rank"
    else:
        sharding = f"1 of {heads} KV heads per rank, each head on {g.per_rank_duplication} ranks"
    con.print(f"  {bpt_s} B/token; {_n(g.copy_block_bytes)} B per block (one copy)")
    con.print(f"  per rank: {_n(g.block_bytes)} B per block ({sharding}; t = "
              f"{g.per_rank_duplication})")
    if g.unpadded_block_bytes != g.copy_block_bytes:
        con.print(f"  without per-component page padding: {_n(g.unpadded_block_bytes)} B/block")
    con.print(f"  [dim]source: {escape(g.source)}[/]")


def _render_device(con: Console, d: DeviceLimits) -> None:
    """The device's block sizes and direct-I/O alignment, and where they come from."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"Device {escape(d.path)} ({d.kind})", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False)
    for col in ("logical", "physical", "size", "DIO offset", "DIO buffer", "from"):
        t.add_column(col, justify="right" if col != "from" else "left", no_wrap=True)
    t.add_row(f"{d.logical_block_size} B", f"{d.physical_block_size} B",
              f"{_n(d.size_bytes)} B ({format_size(d.size_bytes)})",
              f"{d.dio_offset_align} B", f"{d.dio_mem_align} B", d.dio_source)
    con.print(t)
    for note in d.notes:
        con.print(f"  [dim]{escape(note)}[/]")


def _render_objects(con: Console, report: AuditReport) -> None:
    """The objects' alignment plans (aligned or bounced), with advice per object."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    d = report.device
    title = f"Objects ({report.object_layout} layout)" if report.object_layout else "Objects"
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    multi = any(c.obj.count > 1 for c in report.checks)
    cols = ["object", *(["n"] if multi else []), "bytes", "LBA", "residue", "padded", "LBAs",
            "waste", "strategy"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("object", "strategy") else "right",
                     no_wrap=True)
    for c in report.checks:
        p = c.plan
        strat = "[green]aligned[/]" if p.ok else "[yellow]bounce[/]"
        name = c.obj.name.removeprefix("layer:")
        t.add_row(name, *([str(c.obj.count)] if multi else []), _n(p.nbytes), str(p.lba),
                  _n(p.residue), _n(p.padded_bytes), _n(p.lbas), f"{p.waste_fraction:.2%}",
                  strat)
    con.print(t)
    seen = set()
    for c in report.checks:
        if not c.plan.ok and (c.obj.name, c.plan.lba) not in seen:
            seen.add((c.obj.name, c.plan.lba))
            con.print(f"  • {escape(c.obj.name)} @ {c.plan.lba} B: {escape(c.plan.explanation)}")
        if c.physical_aligned is False:
            con.print(f"  • advice: {c.obj.name} padded to {_n(c.plan.padded_bytes)} B is "
                      f"not a multiple of the {c.physical_block_size}-B physical block "
                      "(read-modify-write on partial blocks)")
        if c.objects_fit is not None and d is not None:
            con.print(f"  • {escape(d.path)} holds {_n(c.objects_fit)} {c.obj.name} object(s) of "
                      f"{_n(c.plan.padded_bytes)} B")


def _render_placements(con: Console, report: AuditReport) -> None:
    """Each extent list's placement check."""
    from rich.markup import escape

    con.print("[bold]Placements[/]")
    for lay in report.layouts:
        a = lay.audit
        name = escape(a.source + (f" [{lay.object_name}]" if lay.object_name else ""))
        mark = "[green]ok[/]" if a.ok else "[red]FAIL[/]"
        parts = [f"{_n(a.extents)} extent(s), {_n(a.misaligned)} misaligned"]
        if a.first_misaligned is not None:
            parts.append(f"first: {escape(a.first_misaligned.message)}")
        if a.overlap is not None:
            parts.append(f"extents {a.overlap[0]} and {a.overlap[1]} overlap")
        if a.beyond_end is not None:
            parts.append(f"extent {a.beyond_end} ends past the device end "
                         f"({_n(a.device_size or 0)} B)")
        con.print(f"  {mark} {name} @ {a.lba} B: " + "; ".join(parts))
