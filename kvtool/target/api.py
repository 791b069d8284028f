"""Library entry points: ``up``, ``down``, ``status``, ``discover``, ``connect``,
``disconnect`` (the CLI wraps these).

config → plan → apply: :func:`plan_up` reads the target and returns the steps;
:func:`up` applies them (rolling back on failure) and records the target in the state
directory so that ``status``/``down`` — and ``load``/``replay`` through :func:`find` —
know what is up and where.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from kvtool.errors import InputError, UsageError, param
from kvtool.target import procs
from kvtool.target import state as st
from kvtool.target.config import TargetConfig
from kvtool.target.document import config_document
from kvtool.target.loader import load_config, parse_config
from kvtool.target.plan import ApplyFailed, Plan, Step, TargetError, apply
from kvtool.target.runtimes import BACKGROUND, open_runtime


class Backend(Protocol):
    name: str

    def plan_up(self, cfg: TargetConfig, previous: TargetConfig | None = None) -> Plan: ...

    def plan_down(self, cfg: TargetConfig) -> Plan: ...

    def status(self, cfg: TargetConfig) -> dict[str, Any]: ...


@dataclass
class Options:
    """Where the backends are (CLI flags override the config file)."""

    configfs_root: str | None = None
    spdk_socket: str | None = None


def runtime_of(cfg: TargetConfig) -> str | None:
    if cfg.backend == "spdk" and cfg.spdk_start:
        return "nvmf_tgt"  # kvtool starts SPDK's nvmf_tgt itself ([spdk] start = true)
    if cfg.backend != "emulator":
        return None
    from kvtool.target.emulator import resolve_runtime
    return resolve_runtime(cfg.runtime, needs_auth=bool(cfg.host_keys()))


def backend_for(cfg: TargetConfig, opts: Options | None = None,
                record: st.TargetState | None = None) -> Backend:
    opts = opts or Options()
    if cfg.backend == "nvmet":
        from kvtool.target.nvmet.backend import NvmetBackend
        return NvmetBackend(opts.configfs_root or cfg.nvmet_root)
    if cfg.backend == "spdk" and not cfg.spdk_start:
        from kvtool.target.spdk.backend import SpdkBackend
        return SpdkBackend(socket_path=opts.spdk_socket or cfg.spdk_socket, timeout=cfg.spdk_timeout)
    runtime = runtime_of(cfg)
    assert runtime is not None
    backend: Backend = open_runtime(runtime, record=record, configfs_root=opts.configfs_root)
    return backend


def previous_config(record: st.TargetState | None) -> TargetConfig | None:
    """The config recorded at the last ``up`` (None when unknown or unreadable)."""
    if record is None:
        return None
    try:
        return parse_config(record.config_text, source=record.config_path,
                            backend=record.backend, runtime=record.runtime, allow_remote=True,
                            check_paths=False, is_json=record.config_format == "json",
                            default_name=record.name)
    except InputError:
        return None


@dataclass
class Result:
    plan: Plan
    applied: int
    record: st.TargetState | None
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.plan.to_json(), "applied": self.applied, "dry_run": self.dry_run,
                "changed": self.applied > 0,
                "state_file": str(self.record.path) if self.record else None}


# -- the JSON documents of kvtool target (docs/json.md) ------------------------------------

def up_document(cfg: TargetConfig, result: Result, opts: Options | None = None
                ) -> dict[str, Any]:
    """``kvtool target up``'s document: the plan and what was applied, then (unless a dry
    run) the target's :func:`status`."""
    doc = {"schema": "kvtool.target.up/2", "name": cfg.name, "backend": cfg.backend,
           "runtime": runtime_of(cfg), **result.to_json()}
    if not result.dry_run:
        doc["status"] = status(cfg, result.record, opts)
    return doc


def down_document(cfg: TargetConfig, result: Result) -> dict[str, Any]:
    """``kvtool target down``'s document."""
    return {"schema": "kvtool.target.down/1", "name": cfg.name, "backend": cfg.backend,
            **result.to_json()}


def status_document(cfg: TargetConfig, record: st.TargetState | None = None,
                    opts: Options | None = None) -> dict[str, Any]:
    """``kvtool target status``'s document: :func:`status` with its schema."""
    return {"schema": "kvtool.target.status/2", **status(cfg, record, opts)}


def nothing_up_document(operation: str) -> dict[str, Any]:
    """The document of ``operation`` (status, down) when no target is recorded at all."""
    return {"schema": f"kvtool.target.{operation}/1", "state": "nothing up",
            "state_dir": str(st.targets_dir())}


def discover_document(address: str, port: int = 4420, hostnqn: str | None = None,
                      timeout: float = 10.0, transport: str = "tcp",
                      host: str = "kvtool") -> dict[str, Any]:
    """``kvtool target discover``'s document: :func:`discover`'s entries and where from."""
    doc: dict[str, Any] = {"schema": "kvtool.target.discover/1", "address": address,
                           "port": port}
    if transport != "tcp" or host != "kvtool":
        doc.update(transport=transport, host="kernel")
    doc["entries"] = discover(address, port, hostnqn=hostnqn, timeout=timeout,
                              transport=transport, host=host)
    return doc


def plan_up(cfg: TargetConfig, opts: Options | None = None) -> Plan:
    record = st.load(cfg.name)
    prev = previous_config(record) if record and record.backend == cfg.backend else None
    return backend_for(cfg, opts, record).plan_up(cfg, prev)


def up(cfg: TargetConfig, opts: Options | None = None, *, dry_run: bool = False,
       on_plan: Callable[[Plan], None] | None = None,
       on_step: Callable[[int, Step], None] | None = None) -> Result:
    """Bring the target to ``cfg``; a no-op when it already matches."""
    runtime = runtime_of(cfg)
    for value, what, key in ((cfg.metrics_port, "metrics port", "metrics_port"),
                             (cfg.busy_poll_us, "busy-poll setting", "busy_poll_us")):
        if value is not None and runtime != "userspace":
            raise UsageError(f"a {what} applies to the emulator's userspace runtime only; this "
                             f"target runs on {cfg.backend}"
                             + (f" ({runtime} runtime)" if runtime else "")
                             + f": use {param('runtime')} userspace, or no {what}", field=key)
    notes = sweep(cfg.name)
    record = st.load(cfg.name)
    _check_ports(cfg)
    if record is not None and (record.backend, record.runtime) != (cfg.backend, runtime_of(cfg)):
        was = record.backend + (f" ({record.runtime} runtime)" if record.runtime else "")
        raise TargetError(f"target {cfg.name!r} is recorded as up on {was}; take it down first "
                          f"(kvtool target down --name {cfg.name}) or choose another name")
    prev = previous_config(record) if record is not None else None
    backend = backend_for(cfg, opts, record)
    plan = backend.plan_up(cfg, prev)
    _stop_orphans(plan, cfg.name, record, "an interrupted up")
    plan.notes[:0] = notes
    if on_plan is not None:
        on_plan(plan)
    if dry_run:
        return Result(plan, 0, record, True)
    try:
        applied = apply(plan, on_step)
    except ApplyFailed:
        # A rollback may have restarted the old background process under a new pid.
        pid = getattr(backend, "pid", None)
        if record is not None and pid != record.pid:
            record.pid = pid
            record.pid_start = procs.start_time(pid) if pid else None
            record.extra = dict(getattr(backend, "extra", {}) or record.extra)
            st.save(record)
        raise
    new = _record(cfg, backend, record, opts)
    if applied or record is None or record.digest != new.digest or record.pid != new.pid \
            or record.pid_start != new.pid_start:
        st.save(new)
    return Result(plan, applied, new, False)


def _record(cfg: TargetConfig, backend: Any, old: st.TargetState | None,
            opts: Options | None) -> st.TargetState:
    text, fmt = _config_text(cfg)
    extra = dict(getattr(backend, "extra", {}) or {})
    opts = opts or Options()
    if opts.configfs_root:
        extra["configfs_root"] = opts.configfs_root
    if opts.spdk_socket:
        extra["spdk_socket"] = opts.spdk_socket
    return st.TargetState(
        name=cfg.name, backend=cfg.backend, runtime=runtime_of(cfg),
        config_path=str(Path(cfg.source).resolve()) if cfg.source else None,
        config_text=text, config_format=fmt, digest=cfg.digest(),
        created=old.created if old is not None and old.digest == cfg.digest() else time.time(),
        pid=getattr(backend, "pid", None), extra=extra,
        pid_start=procs.start_time(backend.pid) if getattr(backend, "pid", None) else None,
        endpoints=[{"nqn": s.nqn, "listeners": [
            {"transport": lst.transport, "address": lst.address, "port": lst.port}
            for lst in cfg.listeners_of(s.nqn)]} for s in cfg.subsystems])


def _config_text(cfg: TargetConfig) -> tuple[str, str]:
    """The config re-serialised as JSON in kvtool's own structure (re-parsable, resolved)."""
    return json.dumps(config_document(cfg), indent=2), "json"


def resolve(config: str | None, name: str | None, *, backend: str | None = None,
            runtime: str | None = None, allow_remote: bool = False,
            check_paths: bool = True) -> tuple[TargetConfig, st.TargetState | None]:
    """The config to act on: a file, or the one recorded for ``name`` (or the only target up)."""
    if config is not None:
        cfg = load_config(config, backend=backend, runtime=runtime, allow_remote=allow_remote,
                          check_paths=check_paths)
        if name is not None:
            cfg = replace(cfg, name=name)
        return cfg, st.load(cfg.name)
    record = find(name)
    recorded = previous_config(record)
    if recorded is None:
        raise InputError(f"the recorded config of target {record.name!r} no longer parses; "
                         "give the config file", file=str(record.path))
    return recorded, record


def default_target(port: int | None = None, name: str | None = None,
                   runtime: str | None = None, metrics_port: int | None = None,
                   busy_poll_us: int | None = None) -> TargetConfig:
    """The built-in default target (:mod:`kvtool.target.default`); ``metrics_port``: the
    userspace runtime's Prometheus port (0: a free one); ``busy_poll_us``: how long its
    event loop polls after activity (0: never; None: the runtime's default, 500)."""
    from kvtool.target import default

    cfg = default.config(port or default.PORT)
    if name is not None:
        cfg = replace(cfg, name=name)
    if runtime is not None:
        cfg = replace(cfg, runtime=runtime)
    if metrics_port is not None:
        cfg = replace(cfg, metrics_port=metrics_port)
    if busy_poll_us is not None:
        cfg = replace(cfg, busy_poll_us=busy_poll_us)
    return cfg


def find(name: str | None = None) -> st.TargetState:
    """The state record of target ``name``; without a name, the only one recorded (or
    the built-in default's, when several are)."""
    if name is not None:
        record = st.load(name) or _orphan_record(name)
        if record is None:
            known = ", ".join(st.names()) or "none"
            raise InputError(f"no target named {name!r} is recorded in {st.targets_dir()} "
                             f"(known: {known})", field="NAME")
        return record
    names = st.names() or sorted({r.target for r in procs.records() if r.config_text})
    if not names:
        raise InputError(f"no target is up (nothing recorded in {st.targets_dir()}); "
                         "run: kvtool target up CONFIG", field="CONFIG")
    from kvtool.target import default

    if len(names) > 1 and default.NAME in names:
        names = [default.NAME]
    if len(names) > 1:
        raise InputError(f"several targets are recorded ({', '.join(names)}); name one "
                         f"({param('name')} NAME) or give the config", field="name")
    record = st.load(names[0]) or _orphan_record(names[0])
    assert record is not None
    return record


def _reload(name: str, record: st.TargetState | None) -> st.TargetState | None:
    """The target's record after a sweep (which may have removed it); an interrupted up's
    record (never saved) stays as it is."""
    if record is not None and record.extra.get("interrupted"):
        return record
    return st.load(name)


def _orphan_record(name: str) -> st.TargetState | None:
    """A target record (not saved) for the processes an interrupted ``up`` of ``name`` left:
    enough for ``status`` and ``down`` to find and stop them."""
    for rec in procs.records(name):
        if rec.config_text:
            return st.TargetState(name=name, backend=rec.backend, runtime=rec.runtime,
                                  config_path=None, config_text=rec.config_text,
                                  config_format="json", digest="", pid=None,
                                  extra={"interrupted": True})
    return None


def sweep(name: str | None = None) -> list[str]:
    """Clean the records whose processes are gone (one note each): process records, and the
    target record whose recorded pid is dead or reused (what it served is gone with it)."""
    notes = procs.sweep(name)
    for target in [name] if name is not None else st.names():
        record = st.load(target)
        if record is None or record.pid is None or record.runtime not in BACKGROUND:
            continue
        from kvtool.target.emulator import recorded_pid_alive
        if not recorded_pid_alive(record.pid, record.pid_start):
            why = ("is gone: the pid now belongs to another process" if st.pid_alive(record.pid)
                   else "is no longer running")
            notes.append(f"target {target!r}: its {record.runtime} process (pid {record.pid}) "
                         f"{why}; its record was removed")
            st.remove(target)
    return notes


def acting_config(cfg: TargetConfig, record: st.TargetState | None) -> tuple[TargetConfig, str]:
    """The config that ``down``/``status`` act on: ``cfg``, unless the target is recorded as
    up on another backend or runtime, then the recorded config (with a note saying so)."""
    if record is None or (record.backend, record.runtime) == (cfg.backend, runtime_of(cfg)):
        return cfg, ""
    recorded = previous_config(record)
    if recorded is None:
        raise InputError(f"target {record.name!r} is recorded as up on {_on(record)}, but its "
                         "recorded config no longer parses", file=str(record.path))
    asked = cfg.backend + (f" ({runtime_of(cfg)} runtime)" if runtime_of(cfg) else "")
    return recorded, (f"target {cfg.name!r} is recorded as up on {_on(record)}: acting on the "
                      f"record, not on {asked}")


def _on(record: st.TargetState) -> str:
    return record.backend + (f" ({record.runtime} runtime)" if record.runtime else "")


def _check_ports(cfg: TargetConfig) -> None:
    """A listener port that a process recorded for another target holds: say which."""
    for lst in cfg.listeners:
        holder = procs.port_holder(lst.port, except_target=cfg.name)
        if holder is not None:
            raise TargetError(f"port {lst.port} is held by target {holder.target!r} "
                              f"({holder.describe()}); take it down first: kvtool target down "
                              f"--name {holder.target}")


def _stop_orphans(plan: Plan, name: str, record: st.TargetState | None, why: str) -> None:
    """Steps that stop the live processes recorded for ``name`` other than the target's
    recorded process (which its backend's plan keeps, or stops on ``down``); on ``down`` a
    plan with no stop step covers none."""
    covered = record.pid if record is not None and (plan.operation == "up" or any(
        s.action == "stop" and s.kind == "process" for s in plan.steps)) else None
    orphans = [r for r in procs.records(name) if r.pid != covered and procs.alive(r)]
    for i, rec in enumerate(orphans):
        plan.steps.insert(i, Step("stop", "process", f"pid {rec.pid}",
                                  f"{rec.role} ({why}); SIGTERM, SIGKILL after "
                                  f"{procs.STOP_TIMEOUT:.0f} s", _stopper(rec), None))


def _stopper(rec: procs.ProcessRecord) -> Callable[[], None]:
    return lambda: procs.stop(rec)


def down(cfg: TargetConfig, record: st.TargetState | None = None, opts: Options | None = None,
         *, dry_run: bool = False, on_plan: Callable[[Plan], None] | None = None,
         on_step: Callable[[int, Step], None] | None = None) -> Result:
    """Remove what ``cfg`` owns; forget the state record.

    The target's record decides how: a target recorded as up on another backend or runtime
    than ``cfg`` names is taken down as recorded, and every process recorded for it
    (:mod:`kvtool.target.procs`, including one left by an interrupted ``up``) is stopped.
    A process that cannot be stopped fails the ``down`` (``ApplyFailed``) and every record
    is kept.
    """
    notes = sweep(cfg.name)
    record = _reload(cfg.name, record)
    cfg, why = acting_config(cfg, record)
    opts = _opts_from_record(opts, record)
    backend = backend_for(cfg, opts, record)
    plan = backend.plan_down(cfg)
    if why:
        notes.append(why)
    _stop_orphans(plan, cfg.name, record, "not the target's recorded process")
    plan.notes[:0] = notes
    if plan.steps:  # "nothing running" notes of a backend that has no step are misleading now
        plan.notes = [n for n in plan.notes if not n.startswith("no ") or "running" not in n]
    if on_plan is not None:
        on_plan(plan)
    if dry_run:
        return Result(plan, 0, record, True)
    applied = apply(plan, on_step)
    st.remove(cfg.name)
    return Result(plan, applied, None, False)


def _opts_from_record(opts: Options | None, record: st.TargetState | None) -> Options:
    opts = opts or Options()
    if record is not None:
        opts = Options(configfs_root=opts.configfs_root or record.extra.get("configfs_root"),
                       spdk_socket=opts.spdk_socket or record.extra.get("spdk_socket"))
    return opts


def status(cfg: TargetConfig, record: st.TargetState | None = None,
           opts: Options | None = None) -> dict[str, Any]:
    """What of ``cfg`` is up, with URLs and per-namespace registration records.

    Schema (docs/target.md): name, backend, runtime, state ("up" | "partial" | "down"),
    config, state_file, pid, processes[] (:func:`kvtool.target.procs.summary`), notes[],
    subsystems[] (nqn, state, allow_any_host, hosts,
    listeners[], namespaces[] with nsid, size, block_size, backing, urls),
    registrations[] (nqn, nsid, trtype, adrfam, traddr, trsvcid, size, block_size, url).
    """
    notes = sweep(cfg.name)
    record = _reload(cfg.name, record)
    cfg, why = acting_config(cfg, record)
    if why:
        notes.append(why)
    opts = _opts_from_record(opts, record)
    backend = backend_for(cfg, opts, record)
    live = backend.status(cfg)
    processes = [procs.summary(r) for r in procs.records(cfg.name)]
    for p in processes:
        if p["running"] and (record is None or p["pid"] != record.pid):
            notes.append(f"{p['role']} pid {p['pid']} of target {cfg.name!r} is running but not "
                         f"recorded as up (an interrupted up?): kvtool target down --name "
                         f"{cfg.name}")
    registrations = []
    for sub in live["subsystems"]:
        for ns in sub["namespaces"]:
            tcp = [lst for lst in sub["listeners"] if lst["transport"] == "tcp"]
            if len(tcp) > 1:  # every path in one URL: kvtool's host fails over between them
                ns["multipath_url"] = multipath_url(tcp, sub["nqn"], ns["nsid"])
            ns["urls"] = []
            for lst in sub["listeners"]:
                url = nvme_url(lst["transport"], lst["address"], lst["port"], sub["nqn"], ns["nsid"])
                ns["urls"].append(url)
                registrations.append({"nqn": sub["nqn"], "nsid": ns["nsid"],
                                      "trtype": lst["transport"], "adrfam": lst.get("family"),
                                      "traddr": lst["address"], "trsvcid": str(lst["port"]),
                                      "size": ns["size"], "block_size": ns["block_size"],
                                      "url": url})
    states = {s["state"] for s in live["subsystems"]}
    overall = "up" if states == {"up"} else ("down" if states <= {"absent"} else "partial")
    if overall == "down" and any(p["running"] for p in processes):
        overall = "partial"
    return {"name": cfg.name, "backend": cfg.backend, "runtime": runtime_of(cfg), "state": overall,
            "config": record.config_path if record else cfg.source,
            "state_file": str(record.path) if record else None,
            "digest_matches": record.digest == cfg.digest() if record else None,
            **{k: v for k, v in live.items() if k not in ("subsystems", "backend")},
            "processes": processes, "notes": notes,
            "subsystems": live["subsystems"], "registrations": registrations}


def multipath_url(listeners: list[dict[str, Any]], nqn: str, nsid: int) -> str:
    addrs = ",".join(f"[{x['address']}]:{x['port']}" if ":" in x["address"]
                     else f"{x['address']}:{x['port']}" for x in listeners)
    return f"nvme+tcp://{addrs}/{nqn}/{nsid}"


def ana(cfg: TargetConfig, record: st.TargetState | None, listener: str, group: int,
        state: str, opts: Options | None = None) -> dict[str, Any]:
    """Change the ANA state of ``group`` on ``listener`` (``ADDR:PORT``) of the running
    target, at once (hosts connected there get the ANA Change notice); the record keeps
    it (``extra.ana``). Backends without run-time ANA changes raise UsageError."""
    from kvtool.target.config import ANA_GROUP_MAX, ANA_STATES
    if state not in ANA_STATES:
        raise UsageError(f"ANA state must be one of {', '.join(ANA_STATES)}", field="state")
    if not 1 <= group <= ANA_GROUP_MAX:
        raise UsageError(f"an ANA group is 1..{ANA_GROUP_MAX}, got {group}", field="group")
    if record is None:
        raise InputError(f"target {cfg.name!r} is not up (nothing recorded in "
                         f"{st.targets_dir()})", field="CONFIG")
    cfg, _why = acting_config(cfg, record)
    lst = next((x for x in cfg.listeners if _addr(x.address, x.port) == listener
                or f"{x.address}:{x.port}" == listener), None)
    if lst is None:
        known = ", ".join(_addr(x.address, x.port) for x in cfg.listeners)
        raise UsageError(f"target {cfg.name!r} has no listener {listener} (it has: {known})",
                         field="listener")
    backend = backend_for(cfg, _opts_from_record(opts, record), record)
    set_ana = getattr(backend, "set_ana", None)
    if set_ana is None:
        on = cfg.backend + (f" ({runtime_of(cfg)} runtime)" if runtime_of(cfg) else "")
        raise UsageError(f"ANA states cannot be changed at run time on {on}; use the "
                         "emulator's userspace runtime", field="listener")
    key = _addr(lst.address, lst.port)
    previous = record.extra.get("ana", {}).get(key, {}).get(str(group), lst.ana_state(group))
    set_ana(cfg, lst, group, state)
    record.extra = {**record.extra, **getattr(backend, "extra", {})}
    record.extra.setdefault("ana", {}).setdefault(key, {})[str(group)] = state
    st.save(record)
    return {"schema": "kvtool.target.ana/1", "name": cfg.name, "listener": key,
            "group": group, "state": state, "previous": previous}


def _addr(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def nvme_url(transport: str, address: str, port: int, nqn: str, nsid: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"nvme+{transport}://{host}:{port}/{nqn}/{nsid}"


def _entries(entries: list[Any]) -> list[dict[str, Any]]:
    return [{"subtype": SUBTYPES.get(e.subtype, str(e.subtype)), "subnqn": e.subnqn,
             "trtype": TRTYPES.get(e.trtype, str(e.trtype)),
             "adrfam": ADRFAMS.get(e.adrfam, str(e.adrfam)), "traddr": e.traddr,
             "trsvcid": e.trsvcid, "portid": e.portid, "cntlid": e.cntlid} for e in entries]


def _kernel_discover(address: str, port: int, hostnqn: str | None,
                     transport: str) -> list[dict[str, Any]]:
    from kvtool.nvme import kernel
    from kvtool.nvme.url import check_nqn, default_hostnqn
    nqn = check_nqn(hostnqn, field="hostnqn") if hostnqn else default_hostnqn()
    try:
        return _entries(kernel.discover(transport, address, port, nqn))
    except kernel.FabricsError as exc:
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENODEV,
                         errno.EADDRNOTAVAIL, errno.ETIMEDOUT):
            raise UsageError(f"no NVMe/{transport.upper()} discovery controller at "
                             f"{address}:{port}: {exc.strerror}", field="ADDRESS") from None
        raise TargetError(f"discovery at {address}:{port} ({transport}) failed: "
                          f"{exc.strerror}") from None


def connect(target: str, *, credentials: Any = None, hostnqn: str | None = None,
            hostid: str | None = None, nr_io_queues: int | None = None,
            ctrl_loss_tmo: int | None = None) -> dict[str, Any]:
    """``kvtool target connect``: attach ``target`` (``nvme+rdma://`` or ``nvme+tcp://``
    URL) with the kernel's host, as ``nvme connect`` does; returns the controller and the
    namespace's block device (``kvtool.target.connect/1``). Connecting again to the same
    subsystem through the same address returns the existing controller (``"new": false``)."""
    from kvtool.nvme import kernel
    from kvtool.store.kernelhost import connect_error, connect_options, parse
    url = parse(target)
    if hostid is not None:
        try:
            hostid = str(uuid.UUID(hostid))
        except ValueError:
            raise UsageError(f"{hostid!r} is not a UUID", field="hostid") from None
    if nr_io_queues is not None and not 1 <= nr_io_queues <= 128:
        raise UsageError(f"must be 1..128, got {nr_io_queues}", field="nr_io_queues")
    opts = connect_options(url, hostnqn=hostnqn, hostid=hostid, credentials=credentials,
                           nr_io_queues=nr_io_queues)
    if ctrl_loss_tmo is not None:
        opts = replace(opts, ctrl_loss_tmo=ctrl_loss_tmo)
    existing = kernel.find(url.transport, url.host, url.port, url.subnqn)
    try:
        ctrl = existing[0] if existing else kernel.connect(opts)
    except kernel.FabricsError as exc:
        raise connect_error(target, opts, exc) from None
    try:
        device = ctrl.block_device(url.nsid)
    except kernel.FabricsError as exc:
        if not existing:
            with contextlib.suppress(kernel.FabricsError):
                kernel.disconnect(ctrl.name)
        raise TargetError(f"{target}: {exc.strerror}") from None
    return {"schema": "kvtool.target.connect/1", "url": str(url), "new": not existing,
            "hostnqn": opts.hostnqn, "hostid": opts.hostid, "nsid": url.nsid,
            "block_device": device, **ctrl.to_json()}


def disconnect(what: str) -> dict[str, Any]:
    """``kvtool target disconnect``: delete the kernel host's controllers named by ``what``:
    a URL (every controller of that subsystem through that address), a controller
    (``nvme3``, ``/dev/nvme3``) or one of its block devices (``/dev/nvme3n1``)."""
    from kvtool.nvme import kernel
    from kvtool.store.kernelhost import parse
    if "://" in what:
        url = parse(what)
        ctrls = kernel.find(url.transport, url.host, url.port, url.subnqn)
    else:
        name = os.path.basename(what)
        ctrls = [c for c in kernel.controllers()
                 if c.name == name or f"/dev/{name}" in c.namespaces().values()]
    if not ctrls:
        raise UsageError(f"no NVMe-oF controller of this host matches {what}", field="TARGET")
    done = []
    for c in ctrls:
        try:
            kernel.disconnect(c.name)
        except kernel.FabricsError as exc:
            raise TargetError(f"cannot disconnect {c.name}: {exc.strerror}") from None
        done.append(c.name)
    return {"schema": "kvtool.target.disconnect/1", "disconnected": done}


TRTYPES = {1: "rdma", 2: "fc", 3: "tcp", 254: "loop"}
ADRFAMS = {1: "ipv4", 2: "ipv6", 3: "ib", 4: "fc", 254: "intra_host"}
SUBTYPES = {1: "discovery-referral", 2: "nvme", 3: "discovery"}


def discover(address: str, port: int = 4420, hostnqn: str | None = None,
             timeout: float = 10.0, transport: str = "tcp",
             host: str = "kvtool") -> list[dict[str, Any]]:
    """The discovery log page of any NVMe/TCP target (kvtool's userspace host), or of any
    NVMe/RDMA or NVMe/TCP target through the kernel's host (``transport="rdma"`` or
    ``host="kernel"``: ``nvme discover``'s way, :mod:`kvtool.nvme.kernel`).

    Each entry: subtype, subnqn, trtype, adrfam, traddr, trsvcid, portid, cntlid (names
    for the coded fields, as nvme-cli prints them).
    """
    if transport not in ("tcp", "rdma"):
        raise UsageError(f"transport must be tcp or rdma, not {transport!r}", field="transport")
    if host not in ("kvtool", "kernel"):
        raise UsageError(f"host must be kvtool or kernel, not {host!r}", field="host")
    if transport == "rdma" or host == "kernel":
        return _kernel_discover(address, port, hostnqn, transport)
    from kvtool.nvme import host as nvme_host
    from kvtool.nvme.pdu import PduError
    from kvtool.nvme.queue import Unreachable
    from kvtool.nvme.url import check_nqn
    if not 0 < timeout < float("inf"):  # also refuses nan
        raise UsageError(f"must be a positive number of seconds, got {timeout}",
                         field="timeout")
    if hostnqn is not None:
        check_nqn(hostnqn, field="hostnqn")
    try:
        entries = nvme_host.discover(address, port, hostnqn=hostnqn, timeout=timeout)
    except Unreachable as exc:
        # nothing there: the address is wrong (bad input), not a target that refused
        raise UsageError(f"no NVMe/TCP target at {address}:{port}: {exc}",
                         field="ADDRESS") from None
    except (OSError, PduError) as exc:
        raise TargetError(f"discovery at {address}:{port} failed: {exc}") from None
    return _entries(entries)
