"""``kvtool target up / down / status / ana / discover / connect / disconnect / export /
keygen``: declarative NVMe-oF targets, and the kernel host's connect.

Thin wrappers over :mod:`kvtool.target.api`; JSON schemas are in docs/target.md.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from kvtool.cli.hostopts import host_options
from kvtool.cli.output import dump_json, emit, json_option, note, want_json
from kvtool.errors import UsageError
from kvtool.target import api
from kvtool.target.config import ANA_STATES, BACKENDS, MAX_BUSY_POLL_US, RUNTIMES
from kvtool.target.plan import Plan, Step

EXAMPLES_UP = """
\b
Example:
  kvtool target up                  # the built-in default: emulator, 1 GiB, 127.0.0.1:4420
  kvtool target up fixtures/targets/demo.toml
  kvtool target up fixtures/targets/spdk-production.toml --allow-remote --dry-run
  kvtool target up /etc/nvmet/config.json --backend nvmet --configfs-root /sys/kernel/config/nvmet
"""


def runtime_flag(runtime: str | None, engine: str | None) -> str | None:
    """``--runtime``, or ``--engine`` (its deprecated name, kept so that old scripts work)
    with a one-line note on stderr; both given is bad usage."""
    if engine is None:
        return runtime
    note("kvtool: --engine is deprecated: use --runtime (same values)")
    if runtime is not None:
        raise UsageError("give --runtime only (--engine is its deprecated name)",
                         field="--engine")
    return engine


def _backend_options(cmd: Any) -> Any:
    @functools.wraps(cmd)
    def command(*args: Any, runtime: str | None = None, engine: str | None = None,
                **kwargs: Any) -> Any:
        return cmd(*args, runtime=runtime_flag(runtime, engine), **kwargs)

    f = click.option("--engine", type=click.Choice(RUNTIMES), hidden=True,
                     help="Deprecated name of --runtime.")(command)
    f = click.option("--spdk-socket", metavar="PATH",
                     help="SPDK RPC socket (default: config, else /var/tmp/spdk.sock).")(f)
    f = click.option("--configfs-root", metavar="DIR",
                     help="nvmet configfs root (default /sys/kernel/config/nvmet).")(f)
    f = click.option("--runtime", type=click.Choice(RUNTIMES),
                     help="How the emulator's target runs (overrides the config's "
                          "[emulator] runtime).")(f)
    f = click.option("--backend", type=click.Choice(BACKENDS),
                     help="Backend (overrides the config's 'backend').")(f)
    return f


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _print_plan(con: Any, plan: Plan, title: str) -> None:
    from kvtool.cli.output import Column, print_table

    rows: list[list[str] | None] = []
    for i, s in enumerate(plan.steps, 1):
        colour = {"create": "green", "link": "green", "start": "green", "load": "green",
                  "delete": "red", "unlink": "red", "stop": "red"}.get(s.action, "yellow")
        rows.append([str(i), f"[{colour}]{s.action}[/]", s.kind, s.target, s.detail])
    print_table(con, [Column("#"), Column("action", justify="left"),
                      Column("object", justify="left"),
                      Column("target", justify="left", wrap=True),
                      Column("detail", justify="left", wrap=True, rank=1)],
                rows, title=title, more="--json has them")


def _show_plan(name: str) -> Any:
    """Print the plan before anything is applied (stdout; nothing with --json)."""
    def show(plan: Plan) -> None:
        if want_json():
            return
        from kvtool.cli.output import console
        con = console()
        if plan.empty:
            what = ("the target already matches the config" if plan.operation == "up"
                    else "nothing of this config is up")
            con.print(f"[bold]{name}[/]: nothing to do — {what} ({plan.backend})")
        else:
            _print_plan(con, plan, f"Plan: target {plan.operation} {name} "
                                   f"({plan.backend}, {_steps(len(plan.steps))})")
        for n in plan.notes:
            con.print(f"  note: {n}")
    return show


def _progress(step_no: int, step: Step) -> None:
    if not want_json():
        note(f"  [{step_no + 1}] {step.describe()}")


@click.group(name="target")
def command() -> None:
    """Provision NVMe-oF targets declaratively (SPDK, kernel nvmet, emulator).

    One TOML file describes subsystems, namespaces, listeners and allowed hosts; `up` shows
    the plan and applies only the difference (a no-op when nothing changed), rolling back
    what it did if a step fails; `down` removes only what the file owns.

    \b
    Example:
      kvtool target up fixtures/targets/demo.toml
      kvtool target status --json
      kvtool target down fixtures/targets/demo.toml
    """


@command.command(short_help="Bring a target up to CONFIG (TOML, kvtool or nvmetcli JSON)",
                 epilog=EXAMPLES_UP)
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@_backend_options
@click.option("--name", help="Target name (default: the config's 'name', else the file stem).")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Listener port of the built-in default target (without CONFIG) [4420].")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@click.option("--allow-remote", is_flag=True, help="Allow non-loopback listener addresses.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve the emulator target's Prometheus metrics on 127.0.0.1:PORT (the "
                   "userspace runtime; 0: a free port; overrides [emulator] metrics_port).")
@click.option("--busy-poll", "busy_poll_us", metavar="USEC",
              type=click.IntRange(0, MAX_BUSY_POLL_US), default=None,
              help="The userspace runtime polls for the next command this long after each "
                   "(0: sleep at once; overrides [emulator] busy_poll_us) [500].")
@json_option
def up(config: str | None, backend: str | None, runtime: str | None, configfs_root: str | None,
       spdk_socket: str | None, name: str | None, port: int | None, dry_run: bool,
       allow_remote: bool, metrics_port: int | None, busy_poll_us: int | None) -> None:
    """Bring a target up to the config CONFIG (TOML, kvtool JSON or nvmetcli JSON).

    Without CONFIG: the built-in default target (kvtool's emulator serving a 1 GiB
    namespace on 127.0.0.1:4420), where `kvtool replay` puts its NVMe tier.
    """
    if config is None:
        cfg = api.default_target(port=port, name=name, runtime=runtime, metrics_port=metrics_port,
                                 busy_poll_us=busy_poll_us)
    else:
        if port is not None:
            raise UsageError("--port applies to the built-in default target (no CONFIG); "
                             "set the listener port in CONFIG", field="--port")
        cfg, _ = api.resolve(config, name, backend=backend, runtime=runtime,
                             allow_remote=allow_remote, check_paths=(runtime or "") != "qemu")
        if metrics_port is not None:
            cfg = replace(cfg, metrics_port=metrics_port)
        if busy_poll_us is not None:
            cfg = replace(cfg, busy_poll_us=busy_poll_us)
    opts = api.Options(configfs_root=configfs_root, spdk_socket=spdk_socket)
    result = api.up(cfg, opts, dry_run=dry_run, on_plan=_show_plan(cfg.name),
                    on_step=_progress)
    doc = api.up_document(cfg, result, opts)
    emit(doc, lambda con: _after_up(con, doc))


def _after_up(con: Console, doc: dict[str, Any]) -> None:
    if doc["dry_run"]:
        con.print("dry run: nothing was changed")
        return
    if doc["applied"]:
        con.print(f"[green]applied {_steps(doc['applied'])}[/]; state: {doc['state_file']}")
    _status_tables(con, doc["status"])


@command.command(short_help="Tear down what CONFIG (or the recorded target NAME) owns",
                 epilog="""
\b
Example:
  kvtool target down                # the built-in default (or the only target up)
  kvtool target down fixtures/targets/demo.toml
  kvtool target down --name demo --dry-run
""")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@_backend_options
@click.option("--name", help="Target name (when CONFIG is not given, the recorded config is used).")
@click.option("--dry-run", is_flag=True, help="Print the teardown plan and change nothing.")
@json_option
def down(config: str | None, backend: str | None, runtime: str | None, configfs_root: str | None,
         spdk_socket: str | None, name: str | None, dry_run: bool) -> None:
    """Tear down what CONFIG (or the recorded target NAME) owns, in teardown order."""
    if config is None and name is None and _nothing_up("down"):
        return
    cfg, record = api.resolve(config, name, backend=backend, runtime=runtime, allow_remote=True,
                              check_paths=False)
    opts = api.Options(configfs_root=configfs_root, spdk_socket=spdk_socket)
    result = api.down(cfg, record, opts, dry_run=dry_run, on_plan=_show_plan(cfg.name),
                      on_step=_progress)
    doc = api.down_document(cfg, result)

    def human(con: Console) -> None:
        if dry_run:
            con.print("dry run: nothing was changed")
        else:
            con.print(f"[green]{cfg.name} is down[/] ({_steps(result.applied)})")
    emit(doc, human)


@command.command(short_help="Show namespaces, listeners, URLs and records of what is up",
                 epilog="""
\b
Example:
  kvtool target status
  kvtool target status fixtures/targets/demo.toml --json
  kvtool target status --name demo --url
""")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@_backend_options
@click.option("--name", help="Target name (default: the only target recorded).")
@click.option("--url", "url_only", is_flag=True,
              help="Print only the first namespace's nvme+tcp:// URL (for scripts).")
@json_option
def status(config: str | None, backend: str | None, runtime: str | None,
           configfs_root: str | None, spdk_socket: str | None, name: str | None,
           url_only: bool) -> None:
    """Show what is up: namespaces (size, LBA), listeners, URLs, registration records."""
    if config is None and name is None and not url_only and _nothing_up("status"):
        return
    cfg, record = api.resolve(config, name, backend=backend, runtime=runtime, allow_remote=True,
                              check_paths=False)
    doc = api.status_document(cfg, record, api.Options(configfs_root=configfs_root,
                                                       spdk_socket=spdk_socket))
    if url_only:
        urls = [r["url"] for r in doc["registrations"] if r["url"].startswith("nvme+tcp://")]
        if not urls:
            raise UsageError(f"target {cfg.name!r} serves no NVMe/TCP namespace right now",
                             field="--url")
        click.echo(urls[0])
        return
    emit(doc, lambda con: _status_tables(con, doc))


def _ana_text(listener: dict[str, Any]) -> str:
    states = listener.get("ana")
    if not states:
        return ""
    return " (ANA " + ", ".join(f"g{g} {s}" for g, s in states.items()) + ")"


def _nothing_up(operation: str) -> bool:
    """With no CONFIG or --name and no target recorded, say so (exit 0, as a second
    ``target up`` is a no-op) and return True."""
    from kvtool.target import state

    if state.names():
        return False
    doc = api.nothing_up_document(operation)
    emit(doc, lambda con: con.print(f"nothing is up (no target recorded in "
                                    f"{doc['state_dir']})"))
    return True


def _status_tables(con: Console, doc: dict[str, Any]) -> None:
    from kvtool.units import format_size
    state_colour = {"up": "green", "partial": "yellow", "down": "red"}.get(doc["state"], "white")
    extra = f" runtime {doc['runtime']}" if doc.get("runtime") else ""
    con.print(f"[bold]{doc['name']}[/]: [{state_colour}]{doc['state']}[/] ({doc['backend']}{extra})")
    from kvtool.cli.output import Column, print_table

    rows: list[list[str] | None] = []
    for sub in doc["subsystems"]:
        listeners = ", ".join(f"{x['transport']} {x['address']}:{x['port']}" + _ana_text(x)
                              for x in sub["listeners"]) or "-"
        if not sub["namespaces"]:
            rows.append([sub["nqn"], "-", "-", "-", sub["state"], listeners])
        for ns in sub["namespaces"]:
            size = format_size(ns["size"]) if ns.get("size") is not None else "?"
            rows.append([sub["nqn"], str(ns["nsid"]), size, str(ns.get("block_size") or "?"),
                         str(ns.get("backing") or ""), listeners])
    print_table(con, [Column("subsystem", justify="left"), Column("nsid"), Column("size"),
                      Column("LBA", rank=2), Column("backing", justify="left", wrap=True, rank=1),
                      Column("listeners", justify="left", wrap=True)],
                rows, more="--json has them")
    for sub in doc["subsystems"]:
        hosts = "any host" if sub.get("allow_any_host") else (", ".join(sub.get("hosts", []))
                                                              or "no host allowed")
        con.print(f"{sub['nqn']} allows: {hosts}")
    for reg in doc["registrations"]:  # whole lines: people copy them
        con.print(f"nsid {reg['nsid']}: {reg['url']}")
    for sub in doc["subsystems"]:
        for ns in sub["namespaces"]:
            if ns.get("multipath_url"):
                con.print(f"nsid {ns['nsid']} (all paths): {ns['multipath_url']}")
    if doc.get("metrics"):
        con.print(f"metrics: {doc['metrics']}")
    for proc in doc.get("processes", []):
        state = "running" if proc["running"] else "gone"
        ports = ", ".join(map(str, proc["ports"])) or "-"
        con.print(f"process: {proc['role']} pid {proc['pid']} ({state}, {proc['phase']}; "
                  f"ports {ports}; record {Path(proc['record']).name})")
    for n in doc.get("notes", []):
        con.print(f"  note: {n}")


@command.command(short_help="Print the discovery log page of an NVMe/TCP or NVMe/RDMA target",
                 epilog="""
\b
Example:
  kvtool target discover 127.0.0.1:4420
  kvtool target discover 192.168.1.10 --json
  kvtool target discover 10.0.2.15:4420 --transport rdma     # the kernel's host
""")
@click.argument("address")
@click.option("--hostnqn", help="Host NQN to present (default: this machine's).")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds.")
@click.option("--transport", type=click.Choice(["tcp", "rdma"]), default="tcp",
              show_default=True, help="rdma goes through the Linux kernel's host.")
@click.option("--host", type=click.Choice(["kvtool", "kernel"]), default="kvtool",
              show_default=True, help="NVMe-oF host (TCP): kvtool's userspace one or the "
                                      "kernel's.")
@json_option
def discover(address: str, hostnqn: str | None, timeout: float, transport: str,
             host: str) -> None:
    """Print the discovery log page of any NVMe-oF target at ADDRESS[:PORT]."""
    host_addr, port = _split_addr(address)
    doc = api.discover_document(host_addr, port, hostnqn=hostnqn, timeout=timeout,
                                transport=transport, host=host)
    host = host_addr
    entries = doc["entries"]

    def human(con: Console) -> None:
        from kvtool.cli.output import Column, print_table

        names = ("subtype", "subnqn", "trtype", "adrfam", "traddr", "trsvcid", "portid")
        ranks = {"subtype": 1, "adrfam": 3, "portid": 2}
        print_table(con, [Column(c, justify="left", rank=ranks.get(c, 0)) for c in names],
                    [[str(e.get(c, "")) for c in names] for e in entries],
                    title=f"Discovery log of {host}:{port} ({len(entries)} entries)",
                    more="--json has them")
    emit(doc, human)


@command.command(short_help="Attach a remote namespace with the kernel's NVMe-oF host",
                 epilog="""
\b
Example:
  kvtool target connect nvme+rdma://10.0.2.15:4420/nqn.2026-01.io.kvtool:kernel/1
  kvtool target connect nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:demo --json
  kvtool target disconnect /dev/nvme3n1
""")
@click.argument("target", metavar="URL")
@host_options
@click.option("--hostid", metavar="UUID", help="Host ID (default: the host NQN's UUID).")
@click.option("--nr-io-queues", type=int, default=None, help="I/O queues (kernel default: "
              "one per CPU).")
@click.option("--ctrl-loss-tmo", type=click.IntRange(-1, 3600), default=None,
              help="Seconds to keep reconnecting a lost controller before failing I/O "
                   "(default 10; -1: forever).")
@json_option
def connect(target: str, credentials: Any, hostid: str | None, nr_io_queues: int | None,
            ctrl_loss_tmo: int | None) -> None:
    """Connect URL (nvme+rdma:// or nvme+tcp://, …/SUBNQN[/NSID]) through /dev/nvme-fabrics,
    as nvme connect does, and print the namespace's block device."""
    if credentials is not None and credentials.initiator == "kvtool":
        raise UsageError("target connect always uses the kernel's host", field="--host")
    doc = api.connect(target, credentials=credentials, hostid=hostid,
                      nr_io_queues=nr_io_queues, ctrl_loss_tmo=ctrl_loss_tmo)
    emit(doc, lambda con: con.print(doc["block_device"]))


@command.command(short_help="Detach what target connect (or nvme connect) attached",
                 epilog="""
\b
Example:
  kvtool target disconnect /dev/nvme3n1
  kvtool target disconnect nvme+rdma://10.0.2.15:4420/nqn.2026-01.io.kvtool:kernel
""")
@click.argument("what", metavar="URL|DEVICE")
@json_option
def disconnect(what: str) -> None:
    """Delete the kernel host's controllers of URL, or of a controller or block device
    (nvme3, /dev/nvme3, /dev/nvme3n1)."""
    doc = api.disconnect(what)
    emit(doc, lambda con: con.print("disconnected " + ", ".join(doc["disconnected"])))


@command.command(short_help="Change a listener's ANA state on a running target",
                 epilog="""
\b
Example:
  kvtool target ana fixtures/targets/multipath.toml --listener 127.0.0.1:4421 --state inaccessible
  kvtool target ana --name multipath --listener 127.0.0.1:4420 --group 1 --state optimized
""")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@_backend_options
@click.option("--name", help="Target name (when CONFIG is not given, the recorded config is used).")
@click.option("--listener", required=True, metavar="ADDR:PORT", help="The listener (path).")
@click.option("--group", type=click.IntRange(1, 128), default=1, show_default=True,
              help="ANA group.")
@click.option("--state", required=True, type=click.Choice(ANA_STATES), help="New ANA state.")
@json_option
def ana(config: str | None, backend: str | None, runtime: str | None, configfs_root: str | None,
        spdk_socket: str | None, name: str | None, listener: str, group: int,
        state: str) -> None:
    """Change the ANA state of GROUP on one listener of a running target, at once: hosts
    connected there get an ANA Change notice and move their I/O (kvtool's host, Linux
    native multipath)."""
    cfg, record = api.resolve(config, name, backend=backend, runtime=runtime, allow_remote=True,
                              check_paths=False)
    doc = api.ana(cfg, record, listener, group, state,
                  api.Options(configfs_root=configfs_root, spdk_socket=spdk_socket))
    emit(doc, lambda con: con.print(f"{doc['name']}: {doc['listener']} group {doc['group']}: "
                                    f"{doc['previous']} -> [bold]{doc['state']}[/]"))


@command.command(short_help="Write a new DH-HMAC-CHAP secret (DHHC-1) to a file",
                 epilog="""
\b
Example:
  kvtool target keygen host1.key
  kvtool target keygen ctrl.key --transform sha256 --nqn nqn.2026-01.io.kvtool:demo
""")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--transform", type=click.Choice(["none", "sha256", "sha384", "sha512"]),
              default="none", show_default=True,
              help="Store the key transformed over --nqn (nvme gen-dhchap-key -m 1..3).")
@click.option("--length", type=click.Choice(["32", "48", "64"]),
              help="Key bytes (default 32; a transformed key has its hash's length).")
@click.option("--nqn", help="The NQN a transformed key is bound to (host NQN for a host key, "
              "subsystem NQN for a controller key).")
@json_option
def keygen(file: str, transform: str, length: str | None, nqn: str | None) -> None:
    """Write a new DH-HMAC-CHAP secret (DHHC-1 format, as nvme gen-dhchap-key) to FILE with
    mode 0600. The secret is never printed: point --dhchap-secret or a target config's
    dhchap_key_file at FILE."""
    from kvtool.target.keys import keygen as make_key

    doc = make_key(file, transform=transform, length=int(length) if length else None, nqn=nqn)
    emit(doc, lambda c: c.print(f"wrote {doc['path']} ({doc['format']}, {doc['key_bytes']}-byte "
                                f"key, mode {doc['mode']})"))


def _split_addr(text: str) -> tuple[str, int]:
    host, port = text, 4420
    if text.startswith("["):
        inner, _, rest = text[1:].partition("]")
        host = inner
        if rest.startswith(":"):
            port = _port(rest[1:])
    elif text.count(":") == 1:
        host, p = text.split(":")
        port = _port(p)
    import ipaddress
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise UsageError(f"{host!r} is not an IP address", field="ADDRESS") from None
    return host, port


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UsageError(f"{text!r} is not a TCP port", field="ADDRESS")
    return int(text)


@command.command(short_help="Print CONFIG's state as SPDK, nvmetcli or kvtool JSON",
                 epilog="""
\b
Example:
  kvtool target export fixtures/targets/spdk-production.toml --format spdk > spdk.json
  kvtool target export fixtures/targets/nvmet-dev.toml --format nvmetcli
  kvtool target export fixtures/targets/nvmet-dev.toml --format nvmetcli --live
""")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["spdk", "nvmetcli", "kvtool"]),
              default="kvtool", show_default=True,
              help="spdk: framework_get_config-style JSON (spdk_tgt -c); nvmetcli: "
                   "/etc/nvmet/config.json; kvtool: the normalised config.")
@click.option("--live", is_flag=True,
              help="Export the running target instead of the desired state "
                   "(nvmetcli: the configfs tree; spdk: framework_get_config).")
@_backend_options
def export(config: str, fmt: str, live: bool, backend: str | None, runtime: str | None,
           configfs_root: str | None, spdk_socket: str | None) -> None:
    """Print CONFIG's desired (or, with --live, actual) state as SPDK, nvmetcli or kvtool JSON."""
    cfg, _ = api.resolve(config, None, backend=backend, runtime=runtime, allow_remote=True,
                         check_paths=False)
    doc: Any
    if fmt == "spdk":
        from kvtool.target.spdk.backend import SpdkBackend, spdk_config
        if live:
            doc = SpdkBackend(socket_path=spdk_socket or cfg.spdk_socket).live_config()
        else:
            doc = spdk_config(cfg)
    elif fmt == "nvmetcli":
        from kvtool.target.nvmet import nvmetcli
        if live:
            from kvtool.target.nvmet.backend import NvmetBackend
            doc = nvmetcli.dump_tree(NvmetBackend(configfs_root or cfg.nvmet_root).root)
        else:
            doc = nvmetcli.from_config(cfg)
    else:
        if live:
            raise UsageError("--live needs --format spdk or nvmetcli", field="--live")
        doc = api.config_document(cfg)
    click.echo(dump_json(doc))
