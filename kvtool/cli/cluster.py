"""``kvtool cluster up / status / down``: a cluster file's nodes as network namespaces with
Ray, or as hosts of the user's Ray cluster, with NVMe/TCP targets and Mooncake
(docs/cluster.md)."""

from __future__ import annotations

from typing import Any

import click

from kvtool.cli.output import emit, json_option, note
from kvtool.target.runtimes import CLUSTER

EPILOG = """
\b
Examples:
  kvtool cluster up fixtures/clusters/gp7000-mini.toml
  kvtool cluster up fixtures/clusters/gp7000-mini.toml --runtime spdk
  kvtool cluster status --json
  kvtool bench --cluster fixtures/clusters/gp7000-mini.toml --block-bytes 1MiB
  kvtool cluster down fixtures/clusters/gp7000-mini.toml

Needs root (network namespaces; not for [placement] kind = "hosts", which joins your
Ray cluster) and the cluster extra (pip install 'kvtool[cluster]'; Mooncake:
kvtool[mooncake]).
"""


@click.group("cluster", epilog=EPILOG)
def command() -> None:
    """Bring a cluster file's nodes up and down (namespaces or Ray hosts, targets,
    Mooncake)."""


@command.command("up", short_help="Make the nodes of FILE's [placement] and start everything on them",
                 epilog=EPILOG)
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--runtime", type=click.Choice(CLUSTER), default=None,
              help="How the storage nodes' NVMe/TCP targets run: kvtool's userspace target "
              "(default) or SPDK's nvmf_tgt (as kvtool target up --runtime).")
@click.option("--engine", type=click.Choice(CLUSTER), default=None, hidden=True,
              help="Deprecated name of --runtime.")
@json_option
def up_cmd(file: str, runtime: str | None, engine: str | None) -> None:
    """Make the nodes of FILE's [placement] and start everything on them."""
    from kvtool.cli.target import runtime_flag
    from kvtool.cluster import lifecycle

    state = lifecycle.up(file, runtime=runtime_flag(runtime, engine) or CLUSTER[0], step=note)
    doc = lifecycle.status(state)
    emit(doc, lambda con: render(con, doc))


@command.command("status", short_help="Report every node, engine, target and pool, each checked",
                 epilog=EPILOG)
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@json_option
def status_cmd(file: str | None) -> None:
    """Report every node, engine, target URL and pool URL, each checked to be there
    (FILE may be left out when one cluster is recorded)."""
    from kvtool.cluster import lifecycle
    from kvtool.cluster.state import load_state, names
    from kvtool.errors import UsageError

    if file is None:
        recorded = names()
        if len(recorded) != 1:
            if not recorded:
                emit(lifecycle.not_up(None),
                     lambda con: con.print("no cluster is recorded (kvtool cluster up FILE)"))
                return
            raise UsageError(f"{len(recorded)} clusters are recorded ({', '.join(recorded)}): "
                             "name one by its FILE", field="FILE")
        file = recorded[0]
    state = load_state(file)
    if state is None:
        emit(lifecycle.not_up(file), lambda con: con.print(f"{file}: not up"))
        return
    doc = lifecycle.status(state)
    emit(doc, lambda con: render(con, doc))


@command.command("down", short_help="Remove every namespace, bridge, process and Ray instance",
                 epilog=EPILOG)
@click.argument("file", type=click.Path(dir_okay=False))
@json_option
def down_cmd(file: str) -> None:
    """Remove every namespace, bridge, veth, process and Ray instance `up` made (exit 1,
    naming them, when something stays)."""
    from kvtool.cluster import lifecycle
    from kvtool.cluster.state import load_state

    state = load_state(file)
    if state is None:
        emit(lifecycle.nothing_to_remove(file),
             lambda con: con.print(f"{file}: not up (nothing recorded)"))
        return
    doc = lifecycle.down(state, step=note)
    emit(doc, lambda con: con.print(f"cluster {doc['name']}: down ({len(doc['removed'])} "
                                    "things removed)"))


def _mark(ok: bool) -> str:
    return "[green]ok[/]" if ok else "[red]missing[/]"


def render(con: Any, doc: dict[str, Any]) -> None:
    from rich import box

    from kvtool.cli.output import Column, print_table

    health = "[green]healthy[/]" if doc["healthy"] else "[red]not healthy[/]"
    con.print(f"cluster [bold]{doc['name']}[/]: {doc['phase']}, {health}")
    if doc.get("error"):
        con.print(f"  error: {doc['error']}")
    if doc["kind"] == "hosts":
        con.print(f"  Ray head {doc['ray_address']} (yours) · hosts")
        if doc.get("ray_error"):
            con.print(f"  [red]{doc['ray_error']}[/]")
    else:
        con.print(f"  Ray head {doc['ray_address']} · subnet {doc['subnet']} · bridge "
                  f"{doc['bridge']}")
    rows: list[list[str] | None] = []
    for n in doc["nodes"]:
        link = "unshaped" if n["link_mbit_now"] is None else f"{n['link_mbit_now']:g} Mb/s"
        if n.get("link_up") is False:
            link = "[red]down[/]"  # cut (ip link set eth0 down in its namespace)
        rows.append([n["name"], n["address"], ", ".join(n["roles"]) or "-", link,
                     _mark(n["present"]), _mark(n["ray"]), ", ".join(n["engines"]) or "-"])
    print_table(con, [Column("node", justify="left"), Column("address", justify="left"),
                      Column("roles", justify="left", wrap=True),
                      Column("link (tbf)", justify="left"),
                      Column("Ray node" if doc["kind"] == "hosts" else "netns"),
                      Column("agent" if doc["kind"] == "hosts" else "Ray"),
                      Column("engines", justify="left", wrap=True, rank=1)],
                rows, box=box.SIMPLE_HEAD, more="--json has them")
    for t in doc["targets"]:
        con.print(f"  target {t['name']} ({t['node']}, {t['runtime']}): {_mark(t['running'])}")
        con.print(f"  {t['url']}")
    if doc["mooncake"] is not None:
        m = doc["mooncake"]
        con.print(f"  pool {m['url']}")
        con.print(f"    segments on {', '.join(s['node'] for s in m['segments'])}")
    missing = [r for r in doc["resources"] if not r["present"]]
    for r in missing:
        con.print(f"  [red]missing[/]: {r['kind']} {r['what']}")
