"""``python -m emulator.nvmetcp``: run the userspace NVMe/TCP target in the foreground.

Once every listener is bound it prints exactly one line to stdout and flushes it::

    ready nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:demo [more URLs...]

(one URL per subsystem and listener, space-separated). ``--ready-file PATH`` also writes
``{"pid", "urls", "listen", "discovery"}`` as JSON to PATH (atomically). SIGTERM or SIGINT
stops it cleanly: connections are closed, file backings flushed (fdatasync) and closed,
exit status 0. Bad options or config: one line on stderr, exit 2.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import click

from emulator.nvmetcp.config import MAX_MDTS, EmulatorConfig, HostKeyConfig, simple_config
from emulator.nvmetcp.target import Target
from emulator.nvmetcp.transport import new_event_loop
from kvtool.errors import InputError, KvtoolError, UsageError

# Polls through the gap between a completion and a QD 1 host's next command (~0.3 ms for
# 1 MiB here); measured in BENCHMARKS.md.
DEFAULT_BUSY_POLL_US = 500

EPILOG = """
\b
Examples:
  python -m emulator.nvmetcp --nqn nqn.2026-01.io.kvtool:demo --backing 64MiB --allow-any-host
  python -m emulator.nvmetcp --listen 127.0.0.1:4420 --nqn nqn.2026-01.io.kvtool:demo \\
      --backing /var/tmp/ns1.img --size 1GiB --lba 4096 --host nqn.2014-08.org.nvmexpress:uuid:...
  python -m emulator.nvmetcp --config target.json --ready-file /run/kvtool/target.ready
  python -m emulator.nvmetcp --nqn nqn.2026-01.io.kvtool:demo --backing 64MiB --host HOSTNQN \\
      --dhchap-key HOSTNQN=/etc/kvtool/host.key --dhchap-ctrl-key HOSTNQN=/etc/kvtool/ctrl.key
"""


@click.command(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"],
                                                "max_content_width": 100})
@click.option("--listen", "listen", multiple=True, metavar="HOST:PORT",
              help="Address to listen on (repeatable; default 127.0.0.1:4420; port 0 = any).")
@click.option("--allow-remote", is_flag=True,
              help="Allow a non-loopback --listen address (off by default).")
@click.option("--nqn", help="Subsystem NQN (one subsystem, namespace 1).")
@click.option("--backing", metavar="FILE|SIZE",
              help="Namespace 1: an existing file or block device, or a size (64MiB) for memory.")
@click.option("--size", metavar="SIZE", help="Create --backing FILE with this size if missing.")
@click.option("--lba", type=click.Choice(["512", "4096"]), default="512", show_default=True,
              help="Logical block size of namespace 1.")
@click.option("--host", "hosts", multiple=True, metavar="HOSTNQN",
              help="Host NQN allowed to connect (repeatable).")
@click.option("--allow-any-host", is_flag=True, help="Let any host NQN connect.")
@click.option("--dhchap-key", "dhchap_keys", multiple=True, metavar="HOSTNQN=FILE",
              help="DH-HMAC-CHAP: HOSTNQN must prove the secret in FILE (mode 0600) on every "
                   "queue (repeatable).")
@click.option("--dhchap-ctrl-key", "dhchap_ctrl_keys", multiple=True, metavar="HOSTNQN=FILE",
              help="DH-HMAC-CHAP: the controller's secret for HOSTNQN (bidirectional).")
@click.option("--dhchap-hash", metavar="LIST",
              help="Allowed hashes, preferred first (default sha256,sha384,sha512).")
@click.option("--dhchap-dhgroup", metavar="LIST",
              help="Allowed DH groups, preferred first (default null,ffdhe2048,...,ffdhe8192).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="JSON config with several subsystems/namespaces (docs/nvme-tcp.md).")
@click.option("--mdts", type=int, help=f"Max transfer 2^MDTS × 4 KiB (1..{MAX_MDTS}; default 8).")
@click.option("--queue-size", type=int, help="Max entries per queue (default 128).")
@click.option("--io-queues", type=int, help="Max I/O queues per controller (default 8).")
@click.option("--ready-file", type=click.Path(dir_okay=False),
              help="Write a JSON readiness record here once listening.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT (commands, bytes, errors).")
@click.option("--busy-poll", "busy_poll_us", type=click.IntRange(0, 1_000_000),
              default=DEFAULT_BUSY_POLL_US, show_default=True, metavar="USEC",
              help="After activity, poll for events this many microseconds before sleeping "
                   "(saves a wake-up per command at low queue depth; 0: always sleep).")
@click.option("-v", "--verbose", count=True, help="Log to stderr (-v info, -vv debug).")
def main(listen: tuple[str, ...], allow_remote: bool, nqn: str | None, backing: str | None,
         size: str | None, lba: str, hosts: tuple[str, ...], allow_any_host: bool,
         dhchap_keys: tuple[str, ...], dhchap_ctrl_keys: tuple[str, ...],
         dhchap_hash: str | None, dhchap_dhgroup: str | None,
         config_file: str | None, mdts: int | None, queue_size: int | None,
         io_queues: int | None, ready_file: str | None, metrics_port: int | None,
         busy_poll_us: int, verbose: int) -> None:
    """Run kvtool's userspace NVMe/TCP target until SIGTERM/SIGINT."""
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)],
                        format="nvmetcp: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        cfg = _config(listen, allow_remote, nqn, backing, size, int(lba), hosts,
                      allow_any_host, config_file, mdts, queue_size, io_queues)
        _add_keys(cfg, dhchap_keys, dhchap_ctrl_keys, dhchap_hash, dhchap_dhgroup)
        metrics, metrics_url = None, None
        if metrics_port is not None:
            from emulator.nvmetcp.metrics import TargetMetrics
            from kvtool.metrics import serve_registry

            metrics = TargetMetrics()
            port = serve_registry(metrics.registry, metrics_port)
            metrics_url = f"http://127.0.0.1:{port}/metrics"
            logging.getLogger("emulator.nvmetcp").info("metrics on 127.0.0.1:%d", port)
        try:
            target = Target(cfg, metrics=metrics)
        except InputError as exc:
            if config_file:  # name the file: opening a backing does not know it
                raise InputError(exc.message, file=exc.file or config_file, line=exc.line,
                                 field=exc.field) from None
            raise UsageError(getattr(exc, "message", str(exc)),
                             field=_option(getattr(exc, "field", None) or "")) from None
    except KvtoolError as exc:
        click.echo(f"nvmetcp: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    try:
        with asyncio.Runner(loop_factory=lambda: new_event_loop(busy_poll_us / 1e6)) as runner:
            runner.run(_run(target, ready_file, metrics_url, config_file))
    except (OSError, KvtoolError) as exc:
        message = str(exc) if isinstance(exc, KvtoolError) else \
            f"cannot listen: {exc.strerror or exc}"
        click.echo(f"nvmetcp: error: {message}", err=True)
        target.close_backings()
        sys.exit(2)


def _config(listen: tuple[str, ...], allow_remote: bool, nqn: str | None, backing: str | None,
            size: str | None, lba: int, hosts: tuple[str, ...], allow_any_host: bool,
            config_file: str | None, mdts: int | None, queue_size: int | None,
            io_queues: int | None) -> EmulatorConfig:
    if config_file:
        for name, value in (("--nqn", nqn), ("--backing", backing), ("--size", size),
                            ("--host", hosts), ("--allow-any-host", allow_any_host)):
            if value:
                raise UsageError("give either --config or the single-subsystem options",
                                 field=name)
        cfg = EmulatorConfig.load(config_file)
        if listen:
            cfg.listen = list(listen)
        cfg.allow_remote = cfg.allow_remote or allow_remote
    else:
        if not nqn:
            raise UsageError("required (or use --config)", field="--nqn")
        if not backing:
            raise UsageError("required: a file, a block device or a size such as 64MiB",
                             field="--backing")
        if not hosts and not allow_any_host:
            raise UsageError("no host may connect: give --host HOSTNQN or --allow-any-host",
                             field="--host")
        try:
            cfg = simple_config(nqn=nqn, backing=backing, size=size, lba_size=lba,
                                hosts=list(hosts), allow_any_host=allow_any_host,
                                listen=list(listen) or None, allow_remote=allow_remote)
        except KvtoolError as exc:
            raise UsageError(getattr(exc, "message", str(exc)),
                             field=_option(getattr(exc, "field", None) or "")) from None
    limits: list[tuple[str, str, int | None]] = [
        ("--mdts", "mdts", mdts), ("--queue-size", "max_queue_size", queue_size),
        ("--io-queues", "max_io_queues", io_queues)]
    for option, attr, limit in limits:
        if limit is not None:
            setattr(cfg, attr, limit)
            try:
                cfg.validate()
            except KvtoolError as exc:
                raise UsageError(getattr(exc, "message", str(exc)), field=option) from None
    return cfg.validate()


def _pairs(values: tuple[str, ...], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        nqn, sep, path = v.partition("=")
        if not sep or not nqn or not path:
            raise UsageError(f"expected HOSTNQN=FILE, got {v!r}", field=option)
        out[nqn] = path
    return out


def _add_keys(cfg: EmulatorConfig, keys: tuple[str, ...], ctrl_keys: tuple[str, ...],
              hashes: str | None, groups: str | None) -> None:
    """The --dhchap-* options as ``host_keys`` entries (on top of a --config file's)."""
    host = _pairs(keys, "--dhchap-key")
    ctrl = _pairs(ctrl_keys, "--dhchap-ctrl-key")
    for nqn in ctrl:
        if nqn not in host:
            raise UsageError(f"{nqn} has a controller key but no --dhchap-key",
                             field="--dhchap-ctrl-key")
    if (hashes or groups) and not host:
        raise UsageError("applies to hosts given with --dhchap-key",
                         field="--dhchap-hash" if hashes else "--dhchap-dhgroup")
    hash_list = [h.strip() for h in hashes.split(",")] if hashes else []
    group_list = [g.strip() for g in groups.split(",")] if groups else []
    for nqn, path in host.items():
        cfg.host_keys.append(HostKeyConfig(nqn, path, ctrl.get(nqn), hash_list, group_list))
    try:
        cfg.validate()
    except KvtoolError as exc:
        fld = getattr(exc, "field", "") or ""
        option = ("--dhchap-hash" if "hashes" in fld else "--dhchap-dhgroup" if "dhgroups" in fld
                  else "--dhchap-key")
        raise UsageError(getattr(exc, "message", str(exc)), field=option) from None


def _option(config_field: str) -> str:
    """The command-line option behind a config field of the single-subsystem form."""
    for prefix, option in (("subsystems[0].nqn", "--nqn"),
                           ("subsystems[0].allow_any_host", "--allow-any-host"),
                           ("subsystems[0].hosts", "--host"),
                           ("subsystems[0].namespaces[0].lba_size", "--lba"),
                           ("subsystems[0].namespaces[0].size", "--size"),
                           ("subsystems[0].namespaces[0]", "--backing"),
                           ("listen", "--listen"), ("size", "--size"),
                           ("host_keys", "--dhchap-key")):
        if config_field.startswith(prefix):
            return option
    return config_field


async def _run(target: Target, ready_file: str | None, metrics_url: str | None,
               config_file: str | None = None) -> None:
    loop = asyncio.get_running_loop()
    await target.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, target.request_stop)
    if config_file:
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload_ana(target, config_file))
    urls = target.urls()
    if ready_file:
        record = {"pid": os.getpid(), "urls": urls,
                  "listen": [f"{h}:{p}" for h, p in target.addresses],
                  "discovery": target.discovery_url(), "metrics": metrics_url}
        path = Path(ready_file)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            raise UsageError(f"cannot write {path}: {exc.strerror or exc}",
                             field="--ready-file") from None
    sys.stdout.write("ready " + " ".join(urls) + "\n")
    sys.stdout.flush()
    await target.serve()


def _reload_ana(target: Target, config_file: str) -> None:
    """SIGHUP: apply the config file's ``ana`` states (``kvtool target ana`` rewrites it) and
    ``closed`` listeners (fault injection);
    a file that does not validate changes nothing and is logged."""
    log = logging.getLogger("emulator.nvmetcp")
    try:
        new = EmulatorConfig.load(config_file)
        target.set_ana(new.ana)
        if new.closed != target.config.closed:
            target.set_closed(new.closed)
    except KvtoolError as exc:
        log.error("SIGHUP: ANA states not changed: %s", exc)
        return
    log.info("SIGHUP: ANA states now %s; closed listeners: %s", target.config.ana,
             target.config.closed)


if __name__ == "__main__":
    main(prog_name="python -m emulator.nvmetcp")
