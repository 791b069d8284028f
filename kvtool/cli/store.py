"""``kvtool store``: look at a kvtool object store (``inspect``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from kvtool.cli.hostopts import host_options
from kvtool.cli.output import emit, json_option, shown_path
from kvtool.errors import CheckFailed, UsageError
from kvtool.units import format_size

if TYPE_CHECKING:
    from rich.console import Console

    from kvtool.nvme.hostauth import HostCredentials

EPILOG = """
\b
Example:
  kvtool store inspect /dev/loop3
  kvtool store inspect /var/tmp/kv.img --objects 10 --json
"""


@click.group("store", epilog=EPILOG)
def command() -> None:
    """Inspect the KV object store on a namespace (layout: docs/store-layout.md)."""


@command.command("inspect", short_help="Show TARGET's superblock and a summary of its index (read-only)",
                 epilog=EPILOG)
@click.argument("target")
@click.option("--objects", "list_objects", type=int, default=0, show_default=True,
              help="Also list the first N objects (slot order).")
@host_options
@json_option
def inspect_command(target: str, list_objects: int, credentials: HostCredentials | None) -> None:
    """Show TARGET's superblock and a summary of its index (read-only). Exit 1 when the
    superblock is damaged, 2 when TARGET holds no kvtool store."""
    from kvtool.store.inspect import inspect

    if list_objects < 0:
        raise UsageError(f"must not be negative, got {list_objects}", field="--objects")
    report = inspect(target, list_objects=list_objects, credentials=credentials)
    emit(report, lambda c: render(c, report))
    if report["superblock_error"]:
        raise CheckFailed(f"{target}: {report['superblock_error']}")


def render(c: Console, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    if r["superblock"] is None:
        c.print(f"[bold red]{shown_path(r['target'])}[/]: {r['superblock_error']}")
        return
    sb, ix = r["superblock"], r["index"]
    t = Table(box=box.SIMPLE, show_header=False, title=f"kvtool store on {shown_path(r['target'])}")
    t.add_column(style="bold")
    t.add_column()
    geo = sb["geometry"]
    t.add_row("uuid", sb["uuid"])
    t.add_row("version", str(sb["version"]))
    t.add_row("LBA", f"{sb['lba_size']} B (physical {sb['physical_block_size']} B)")
    t.add_row("object", f"{sb['object_bytes']:,} B in {sb['slot_bytes']:,} B slots "
              f"(+{ix['padding_bytes_per_object']} B pad)")
    if geo["model"]:
        t.add_row("geometry", f"{geo['model']} {geo['dtype']}, {geo['block_tokens']} tokens/"
                  f"block, TP {geo['tp']}")
    t.add_row("payload", f"{sb['payload']['kind']}, seed {sb['seed']}")
    t.add_row("regions", f"superblock @0, index @{sb['index_offset']} "
              f"({format_size(sb['index_bytes'])}), data @{sb['data_offset']}")
    t.add_row("objects", f"{ix['live']:,} of {ix['slots']:,} slots ({ix['fill']:.1%}), "
              f"{format_size(ix['bytes_stored'])}")
    t.add_row("index", f"{ix['free']:,} free, {ix['stale']} stale, {ix['superseded']} "
              f"superseded, {ix['problems']} damaged")
    if ix["generation_max"] is not None:
        t.add_row("generations", f"{ix['generation_min']} to {ix['generation_max']}")
    for path in ((r.get("engine") or {}).get("multipath") or {}).get("paths", []):
        t.add_row("path", f"{path['address']}: {path['state']}, ANA {path['ana_state']} "
                  f"(group {path['ana_group']})")
    c.print(t)
    if r["problems"]:
        p = Table(box=box.SIMPLE, title="damaged index entries")
        for col in ("slot", "entry_offset", "key", "reason"):
            p.add_column(col, no_wrap=col != "reason")
        for row in r["problems"]:
            p.add_row(str(row["slot"]), str(row["entry_offset"]), row["key"], row["reason"])
        c.print(p)
    if r["objects"]:
        from kvtool.cli.output import Column, print_table

        names = ("slot", "key", "offset", "length", "crc32c", "generation", "ordinal")
        ranks = {"generation": 2, "ordinal": 1, "length": 3}
        print_table(c, [Column(n, justify="left", rank=ranks.get(n, 0)) for n in names],
                    [[str(row[k]) for k in names] for row in r["objects"]],
                    box=box.SIMPLE, title="objects", more="--json has them")
