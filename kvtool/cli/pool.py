"""``kvtool pool up / down / status``: a Mooncake Store pool (master + metadata server) on
127.0.0.1, the DRAM tier of the GP7000 stack (docs/mooncake.md)."""

from __future__ import annotations

from typing import Any

import click

from kvtool.cli.output import emit, json_option

EPILOG = """
\b
Examples:
  kvtool pool up
  kvtool pool up --memory 1GiB --memory-port 50062 --name held   # holds objects itself
  kvtool pool status --json          # "url": the mooncake:// URL to pass as --dram
  kvtool pool up --rpc-port 50061 --metadata-port 8081 --metrics-port 9013 --name b
  kvtool pool down
"""


def _name(f: Any) -> Any:
    return click.option("--name", default="default", show_default=True,
                        help="Pool name (several pools may run on other ports).")(f)


@click.group("pool", epilog=EPILOG)
def command() -> None:
    """Start, stop and report a Mooncake Store pool on 127.0.0.1 (extra kvtool[mooncake])."""


@command.command("up", short_help="Start mooncake_master and the metadata server",
                 epilog=EPILOG)
@_name
@click.option("--rpc-port", type=click.IntRange(1, 65535), default=50051, show_default=True,
              help="mooncake_master RPC port (the mooncake:// URL's port).")
@click.option("--metadata-port", type=click.IntRange(1, 65535), default=8080, show_default=True,
              help="HTTP metadata server port.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=9003, show_default=True,
              help="mooncake_master's Prometheus metrics port.")
@click.option("--watermark", type=click.FloatRange(0, 1, min_open=True), default=0.9,
              show_default=True, help="The master starts evicting above this fill.")
@click.option("--evict-ratio", type=click.FloatRange(0, 1, min_open=True), default=0.05,
              show_default=True, help="Fraction of objects the master evicts per batch.")
@click.option("--memory", default=None, metavar="SIZE",
              help="Memory the pool holds itself (mooncake_client): objects outlive the "
                   "clients that put them [default: none, clients contribute it].")
@click.option("--memory-port", type=click.IntRange(1, 65535), default=50052,
              show_default=True, help="The memory process's port (with --memory).")
@json_option
def up_cmd(name: str, rpc_port: int, metadata_port: int, metrics_port: int, watermark: float,
           evict_ratio: float, memory: str | None, memory_port: int) -> None:
    """Start mooncake_master and the metadata server (does nothing when already up)."""
    from kvtool.mooncake import pool
    from kvtool.units import parse_size

    doc = pool.up(name, rpc_port=rpc_port, metadata_port=metadata_port,
                  metrics_port=metrics_port, eviction_high_watermark=watermark,
                  eviction_ratio=evict_ratio,
                  memory_bytes=parse_size(memory, field="--memory") if memory else 0,
                  memory_port=memory_port)
    emit(doc, lambda con: _render(con, doc))


@command.command("down", short_help="Stop the pool's processes and forget it",
                 epilog=EPILOG)
@_name
@json_option
def down_cmd(name: str) -> None:
    """Stop the pool's processes and forget it."""
    from kvtool.mooncake import pool

    doc = pool.down(name)
    emit(doc, lambda con: con.print(f"pool {name}: " + ("stopped" if doc["changed"]
                                                         else "was not up")))


@command.command("status", short_help="Report the pool: running or not, URL, processes, metrics",
                 epilog=EPILOG)
@_name
@json_option
def status_cmd(name: str) -> None:
    """Report the pool: running or not, its mooncake:// URL, processes, metrics URL."""
    from kvtool.mooncake import pool

    doc = pool.status(name)
    emit(doc, lambda con: _render(con, doc))


def _render(con: Any, doc: dict[str, Any]) -> None:
    from kvtool.units import format_size

    if doc["url"] is None:
        con.print(f"pool {doc['name']}: not up (kvtool pool up)")
        return
    state = "[green]running[/]" if doc["running"] else "[red]not running[/] (kvtool pool down; up)"
    changed = doc.get("changed")
    verb = "" if changed is None else (" (started)" if changed else " (already up)")
    con.print(f"pool {doc['name']}: {state}{verb}")
    con.print(f"  url       {doc['url']}   (pass as --dram)")
    for part in ("master", "metadata", "memory"):
        p = doc.get(part)
        if p is None:
            continue
        con.print(f"  {part:9} pid {p['pid']} · 127.0.0.1:{p['port']} · "
                  + ("alive" if p["alive"] else "dead")
                  + (f" · holds {format_size(doc['memory_bytes'])}" if part == "memory" else ""))
    con.print(f"  metrics   {doc['metrics_url']}")
