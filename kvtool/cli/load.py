"""``kvtool load``: write KV objects of a model's real size onto a namespace."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvtool.cli.hostopts import host_options
from kvtool.cli.options import block_size_from, block_size_options
from kvtool.cli.output import emit, json_option, note, progress, shown_path
from kvtool.errors import UsageError
from kvtool.units import format_size, parse_percent, parse_size

if TYPE_CHECKING:
    from rich.console import Console

    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.store.layout import Geometry

# The store library (numpy, ctypes) is imported inside the commands: every kvtool command
# imports this module at start-up.
DEFAULT_QD = 8  # == kvtool.store.io.DEFAULT_QD

EPILOG = """
\b
Example:
  kvtool load /dev/loop3 --model deepseek-v4-flash --dtype fp8 --fill 80% --qd 16
  kvtool load /var/tmp/kv.img --create 4GiB --block-bytes 32MiB --count 100
  kvtool load /dev/nvme1n1 --model llama-3-70b --tp 4 --count 10000 --ack-file acks.jsonl

\b
The target's first MiB must be blank or hold a kvtool store; anything else (a
filesystem, a partition table, data) is refused unless --force. Re-running the same
command resumes: objects already stored are skipped. Layout and JSON schema:
docs/store-layout.md, docs/store.md.
"""


F = TypeVar("F", bound=Callable[..., Any])


def block_tokens_option(f: F) -> F:
    return click.option("--block-tokens", type=int, default=256, show_default=True,
                        help="Tokens per block (one object per block).")(f)


def resolve_object(model: str | None, dtype: str | None, block_tokens: int, tp: int | None,
                   block_bytes: int | None) -> tuple[int, Geometry]:
    """The object size (one block as one rank stores it) and the superblock's geometry."""
    from kvtool.store.layout import Geometry

    size = block_size_from(model, dtype, tp, block_bytes, block_tokens)
    if size is None:
        raise UsageError("say what to store: --model NAME (with --dtype) or --block-bytes "
                         "SIZE", field="--model")
    if size.model is None:
        return size.block_bytes, Geometry(block_tokens=block_tokens)
    return size.block_bytes, Geometry(size.model, str(size.dtype), block_tokens, size.tp)


def parse_lba(text: str | None) -> int | None:
    if text is None:
        return None
    n = parse_size(text, field="--lba", allow_zero=False)
    if n & (n - 1) or n < 512:
        raise UsageError(f"must be a power of two ≥ 512, got {text!r}", field="--lba")
    return n


@click.command("load", epilog=EPILOG)
@click.argument("target")
@block_size_options
@block_tokens_option
@click.option("--count", type=int, help="Number of objects to store.")
@click.option("--fill", metavar="PERCENT", help="Store objects up to this share of the "
              "target's slots (e.g. 80%). Default: 100% when --count is absent.")
@click.option("--qd", type=int, default=DEFAULT_QD, show_default=True,
              help="Queue depth: object writes in flight.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the keys and payloads (verify regenerates from it).")
@click.option("--force", is_flag=True, help="Overwrite a filesystem, foreign data or an "
              "incompatible kvtool store.")
@click.option("--payload-file", type=click.Path(dir_okay=False),
              help="Tile payloads from a real tensor file (raw bytes or .npy).")
@click.option("--ack-file", type=click.Path(dir_okay=False),
              help="Append one JSON line per durable commit (keys and ordinals acknowledged).")
@click.option("--batch", type=int, default=0,
              help="Objects per commit (default: about 64 MiB worth).")
@click.option("--lba", metavar="SIZE", help="Logical block size to lay out for (a multiple of "
              "the target's; e.g. 4096 on a 512 B file). Default: the target's.")
@click.option("--create", "create", metavar="SIZE",
              help="Create TARGET as a regular file of this size when it does not exist.")
@host_options
@json_option
def command(target: str, model: str | None, dtype: str | None, tp: int | None,
            block_bytes: int | None, block_tokens: int, count: int | None, fill: str | None,
            qd: int, seed: int,
            force: bool, payload_file: str | None, ack_file: str | None, batch: int,
            lba: str | None, create: str | None, credentials: HostCredentials | None) -> None:
    """Write KV objects onto TARGET (block device, file, or nvme+tcp:// URL) with an
    on-device index and per-object CRC32C; every commit is durable before it is
    acknowledged."""
    from kvtool.store.load import AckFile, LoadSpec, load

    size, geometry = resolve_object(model, dtype, block_tokens, tp, block_bytes)
    if count is not None and fill is not None:
        raise UsageError("give either --count or --fill, not both", field="--count")
    if count is not None and count < 1:
        raise UsageError(f"must be at least 1, got {count}", field="--count")
    if batch < 0:
        raise UsageError(f"must not be negative, got {batch}", field="--batch")
    spec = LoadSpec(object_bytes=size, count=count,
                    fill=parse_percent(fill, field="--fill") if fill else None, seed=seed,
                    qd=qd, force=force, geometry=geometry, payload_file=payload_file,
                    batch_objects=batch, lba=parse_lba(lba),
                    create_bytes=parse_size(create, field="--create", allow_zero=False)
                    if create else None)
    acks = AckFile(ack_file) if ack_file else None
    try:
        with progress("load (committed objects)") as bar:
            result = load(target, spec, ack=acks, progress=bar.advance, on_total=bar.set_total,
                          credentials=credentials)
    finally:
        if acks is not None:
            acks.close()
    if result["replaced"]:
        note(f"replaced {result['replaced']}")
    emit(result, lambda c: render(c, result))


def render(c: Console, r: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    sb = r["store"]
    t = Table(box=box.SIMPLE, show_header=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")  # a deep path is folded, never cut
    t.add_row("target", f"{shown_path(r['target'])} ({r['engine']['kind']}, {r['engine']['lba_size']} B LBA)")
    t.add_row("store", f"{sb['uuid']}" + (" (new)" if r["formatted"] else " (resumed)"))
    t.add_row("object", f"{sb['object_bytes']:,} B → slot {sb['slot_bytes']:,} B "
              f"({r['io_path']})")
    t.add_row("objects", f"{r['written']:,} written, {r['already_present']:,} already present, "
              f"{r['objects']:,} stored of {sb['slot_count']:,} slots")
    t.add_row("throughput", f"{r['gb_per_s']:.3f} GB/s, {r['objects_per_s']:,.0f} objects/s, "
              f"QD {r['qd']}, {format_size(r['bytes_written'])} in {r['seconds']:.2f} s")
    t.add_row("commits", f"{r['commits']} (≤ {r['objects_per_commit']} objects each, "
              "durable before acknowledged)")
    c.print(t)
