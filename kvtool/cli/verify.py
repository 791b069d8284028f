"""``kvtool verify``: read every object back, check its checksum and its content."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from kvtool.cli.hostopts import host_options
from kvtool.cli.load import DEFAULT_QD
from kvtool.cli.output import emit, json_option, progress, shown_path
from kvtool.errors import CheckFailed, UsageError
from kvtool.units import format_size

if TYPE_CHECKING:
    from rich.console import Console

    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.store.verify import Sample

EPILOG = """
\b
Example:
  kvtool verify /dev/loop3
  kvtool verify /var/tmp/kv.img --sample 10% --qd 16 --json
  kvtool verify /dev/nvme1n1 --payload-file kv_block.npy

\b
Checks per object: read, checksum (CRC32C vs the index), content (the payload
regenerated from the key), padding (zero pad up to the next LBA). Exit 0 when every
check passes, 1 when any object is bad (each named: key, slot, offset, check), 2 when
TARGET is not a kvtool store.
"""


@click.command("verify", epilog=EPILOG)
@click.argument("target")
@click.option("--qd", type=int, default=DEFAULT_QD, show_default=True,
              help="Queue depth: object reads in flight.")
@click.option("--sample", metavar="N|P%", help="Check N objects, or P% of them, chosen at "
              "random (default: all).")
@click.option("--sample-seed", type=int, help="Seed for --sample (default: random).")
@click.option("--payload-file", type=click.Path(dir_okay=False),
              help="The tensor file the store was loaded from (needed for content checks "
                   "of such a store).")
@click.option("--checksums-only", is_flag=True, help="Skip content checks (CRC32C and padding "
              "only).")
@host_options
@json_option
def command(target: str, qd: int, sample: str | None, sample_seed: int | None,
            payload_file: str | None, checksums_only: bool, credentials: HostCredentials | None) -> None:
    """Verify every object on TARGET (or a --sample): checksum and content; name each bad
    object and exit 1 if any."""
    from kvtool.store.verify import verify

    with progress("verify (objects)") as bar:
        report = verify(target, qd=qd, sample=parse_sample(sample), sample_seed=sample_seed,
                        payload_file=payload_file, checksums_only=checksums_only,
                        progress=bar.advance, on_total=bar.set_total,
                        credentials=credentials)
    emit(report, lambda c: render(c, report))
    if not report["ok"]:
        raise CheckFailed(f"{target}: {len(report['bad'])} problem(s) found "
                          f"({', '.join(sorted({b['check'] for b in report['bad']}))})")


def parse_sample(text: str | None) -> Sample | None:
    """``--sample``: a count (``100``) or a percentage (``10%``)."""
    from kvtool.store.verify import Sample

    if text is None:
        return None
    t = text.strip()
    try:
        return Sample(fraction=float(t[:-1]) / 100) if t.endswith("%") else Sample(count=int(t))
    except ValueError:
        raise UsageError(f"expected a count (100) or a percentage (10%), got {text!r}",
                         field="--sample") from None


def render(c: Console, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    if r["store"] is not None:
        c.print(f"[bold]{shown_path(r['target'])}[/]: {r['objects_checked']:,} of {r['objects_indexed']:,} "
                f"objects checked ({r['content_checked']:,} with content), "
                f"{format_size(r['bytes_checked'])} in {r['seconds']:.2f} s = "
                f"{r['gb_per_s']:.3f} GB/s, QD {r['qd']}")
    if r["ok"]:
        c.print("[green]OK[/]: every checked object matches its checksum and its content")
        return
    t = Table(box=box.SIMPLE, title=f"{len(r['bad'])} problem(s)")
    for col in ("check", "key", "slot", "offset", "detail"):
        t.add_column(col, overflow="fold", no_wrap=col != "detail")
    for b in r["bad"][:200]:
        t.add_row(b["check"], str(b["key"]), str(b["slot"]), str(b["offset"]), b["detail"])
    c.print(t)
    if len(r["bad"]) > 200:
        c.print(f"... {len(r['bad']) - 200} more (use --json for all)")
