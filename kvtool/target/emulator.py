"""The ``emulator`` backend: an NVMe/TCP target on 127.0.0.1 without NVMe-oF hardware.

Runtimes (``[emulator] runtime`` or ``--runtime``):

* ``kernel`` — the host's own nvmet (configfs), when the host kernel has it: the
  :class:`~kvtool.target.nvmet.backend.NvmetBackend` on ``/sys/kernel/config/nvmet``.
* ``qemu`` — the real Linux kernel target in a QEMU guest (:mod:`kvtool.target.guest`),
  configured by the same nvmet backend running inside the guest.
* ``userspace`` — kvtool's own NVMe/TCP target (``python -m emulator.nvmetcp``) as a
  background process: the fastest start, no kernel support needed.
* ``auto`` — kernel when the host has nvmet, else qemu when QEMU is installed, else userspace.

The userspace runtime's process outlives ``kvtool target up``; its pid, config and log are
in the target's state record (:mod:`kvtool.target.state`), which ``status``/``down`` read.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtool.errors import InputError
from kvtool.nvme.spec import is_loopback
from kvtool.target import procs
from kvtool.target import state as st
from kvtool.target.config import Listener, Namespace, TargetConfig
from kvtool.target.plan import Plan, TargetError
from kvtool.target.probe import listener_ana

READY_TIMEOUT = 60.0
STOP_TIMEOUT = procs.STOP_TIMEOUT


def host_has_nvmet() -> bool:
    """True when this kernel can run nvmet (loaded, or loadable as a module)."""
    if Path("/sys/kernel/config/nvmet").is_dir() or Path("/sys/module/nvmet").is_dir():
        return True
    release = os.uname().release
    mod_dir = Path("/lib/modules", release, "kernel/drivers/nvme/target")
    return any(mod_dir.glob("nvmet.ko*")) and Path("/sys/kernel/config").is_dir()


def host_has_nvmet_auth() -> bool:
    """True when this kernel's nvmet can do DH-HMAC-CHAP (CONFIG_NVME_TARGET_AUTH: the
    nvme-auth module is loaded or shipped; Debian bookworm's 6.1 has neither)."""
    if Path("/sys/module/nvme_auth").is_dir():
        return True
    mod_dir = Path("/lib/modules", os.uname().release, "kernel/drivers/nvme/common")
    return any(mod_dir.glob("nvme-auth.ko*"))


def resolve_runtime(runtime: str, *, needs_auth: bool = False) -> str:
    """``auto``: kernel, else qemu, else userspace; with ``needs_auth`` (a host has
    DH-HMAC-CHAP keys) the host kernel only when its nvmet can authenticate."""
    if runtime != "auto":
        return runtime
    if host_has_nvmet() and (not needs_auth or host_has_nvmet_auth()):
        return "kernel"
    if shutil.which("qemu-system-x86_64"):
        return "qemu"
    return "userspace"


def userspace_config(cfg: TargetConfig) -> dict[str, Any]:
    """``cfg`` in the userspace target's ``--config`` JSON (docs/nvme-tcp.md)."""
    subsystems = []
    for s in cfg.subsystems:
        namespaces = []
        for n in s.namespaces:
            ns: dict[str, Any] = {"nsid": n.nsid, "lba_size": n.block_size}
            if n.ana_group is not None:
                ns["anagrpid"] = n.ana_group
            if n.backing == "memory":
                ns["backing"] = f"{n.size}B"
            else:
                ns["backing"] = n.path
                if n.create and n.size:
                    ns["size"] = f"{n.size}B"
            namespaces.append(ns)
        sub: dict[str, Any] = {"nqn": s.nqn, "namespaces": namespaces, "hosts": list(s.hosts),
                               "allow_any_host": s.allow_any_host}
        if s.serial:
            sub["serial"] = s.serial
        if s.model:
            sub["model"] = s.model
        subsystems.append(sub)
    listen = [listen_address(lst) for lst in cfg.listeners]
    out: dict[str, Any] = {"subsystems": subsystems, "listen": listen,
                           "allow_remote": any(not is_loopback(lst.address) for lst in cfg.listeners)}
    keys = [{"nqn": h.nqn, "dhchap_key_file": h.dhchap_key_file,
             "dhchap_ctrl_key_file": h.dhchap_ctrl_key_file,
             "dhchap_hashes": list(h.dhchap_hashes), "dhchap_dhgroups": list(h.dhchap_dhgroups)}
            for h in cfg.host_keys()]
    if keys:
        out["host_keys"] = keys  # key file paths: the target process reads the secrets
    if cfg.listeners:
        out["port_id"] = cfg.listeners[0].id
    ana = {listen_address(lst): {str(g): s for g, s in lst.ana} for lst in cfg.listeners if lst.ana}
    if ana:
        out["ana"] = ana
    t = cfg.transport("tcp")
    if t is not None and t.in_capsule_data_size is not None:
        out["in_capsule_data_size"] = t.in_capsule_data_size
    return out


def listen_address(lst: Any) -> str:
    """A listener as the userspace target's ``listen`` entry: ``ADDR:PORT`` / ``[V6]:PORT``."""
    return f"[{lst.address}]:{lst.port}" if lst.family == "ipv6" else f"{lst.address}:{lst.port}"


def memory_as_files(cfg: TargetConfig, directory: str, runtime: str) -> TargetConfig:
    """Memory namespaces as sparse files in ``directory`` (tmpfs), served with buffered_io.

    The kernel target has no RAM namespace of its own; a file on tmpfs is the same thing.
    Its LBA size is the file system's block size, 4096.
    """
    subs = []
    for si, sub in enumerate(cfg.subsystems):
        nss = []
        for ni, ns in enumerate(sub.namespaces):
            if ns.backing == "memory":
                if ns.lba not in (None, 4096):
                    file, line = cfg.where("subsystem", si, "namespace", ni, "lba")
                    raise InputError(f"the {runtime} runtime serves memory namespaces from a tmpfs "
                                     "file, whose LBA size is 4096; use lba = 4096 (or the "
                                     "userspace runtime for 512)", file=file, line=line,
                                     field=f"subsystem[{si}].namespace[{ni}].lba")
                ns = Namespace(nsid=ns.nsid, backing="file", size=ns.size, create=True,
                               path=f"{directory}/{cfg.name}-s{si}n{ns.nsid}.img",
                               buffered_io=True, uuid=ns.uuid, nguid=ns.nguid,
                               ana_group=ns.ana_group)
            nss.append(ns)
        subs.append(replace(sub, namespaces=tuple(nss)))
    return replace(cfg, subsystems=tuple(subs))


class BackgroundRuntime:
    """An emulator runtime whose target runs as a background process recorded in the state file."""

    name = "emulator"
    runtime = ""

    def __init__(self, record: st.TargetState | None) -> None:
        self.record = record
        self.pid: int | None = record.pid if record is not None else None
        self.extra: dict[str, Any] = dict(record.extra) if record is not None else {}

    def _running(self) -> bool:
        return (self.record is not None and self.record.runtime == self.runtime
                and recorded_pid_alive(self.record.pid, self.record.pid_start))

    def _process_record(self, name: str, role: str, ports: list[int],
                        config_text: str | None = None) -> procs.ProcessRecord:
        """The record of a process this runtime is about to start (saved by the caller
        before the start)."""
        return procs.ProcessRecord(target=name, backend=self.name, runtime=self.runtime, role=role,
                                   ports=sorted(set(ports)), config_text=config_text)


class UserspaceRuntime(BackgroundRuntime):
    """Runs kvtool's userspace NVMe/TCP target as a background process."""

    runtime = "userspace"

    def plan_up(self, cfg: TargetConfig, previous: TargetConfig | None = None) -> Plan:
        plan = Plan(self.name, "up")
        listeners = ", ".join(f"{lst.address}:{lst.port}" for lst in cfg.listeners)
        sets = {lst.subsystems for lst in cfg.listeners}
        if len(sets) > 1:
            plan.notes.append("the userspace runtime serves every subsystem on every listener")
        if self._running():
            assert self.record is not None
            if self.record.digest == cfg.digest():
                return plan  # already serving exactly this config
            old_pid = self.record.pid
            old_cfg = json.loads(self.record.extra.get("runtime_config", "{}"))
            old_port = self.record.extra.get("metrics_port")
            old_poll = self.record.extra.get("busy_poll_us")
            plan.add("stop", "process", f"pid {old_pid}", "userspace target with the old config",
                     lambda: self._stop(old_pid),
                     lambda: self._start(cfg.name, old_cfg, old_port, old_poll))
        new_cfg = userspace_config(cfg)
        nss = sum(len(s.namespaces) for s in cfg.subsystems)
        metrics = ("" if cfg.metrics_port is None else
                   f", Prometheus metrics on 127.0.0.1:{cfg.metrics_port or 'a free port'}")
        plan.add("start", "process", "python -m emulator.nvmetcp",
                 f"{len(cfg.subsystems)} subsystem(s), {nss} namespace(s) on {listeners}"
                 f"{metrics}",
                 lambda: self._start(cfg.name, new_cfg, cfg.metrics_port, cfg.busy_poll_us,
                                     config_json(cfg)),
                 lambda: self._stop(self.pid))
        return plan

    def plan_down(self, cfg: TargetConfig) -> Plan:
        plan = Plan(self.name, "down")
        if self._running():
            assert self.record is not None
            pid = self.record.pid
            old_cfg = json.loads(self.record.extra.get("runtime_config", "{}"))
            old_port = self.record.extra.get("metrics_port")
            old_poll = self.record.extra.get("busy_poll_us")
            plan.add("stop", "process", f"pid {pid}", "SIGTERM, clean shutdown (flushes backing files)",
                     lambda: self._stop(pid),
                     lambda: self._start(cfg.name, old_cfg, old_port, old_poll, config_json(cfg)))
        else:
            plan.notes.append("no userspace target is running for this config")
        return plan

    def _start(self, name: str, runtime_cfg: dict[str, Any],
               metrics_port: int | None = None, busy_poll_us: int | None = None,
               config_text: str | None = None) -> None:
        d = st.run_dir()
        d.mkdir(parents=True, exist_ok=True)
        cfg_path = d / f"{name}.userspace.json"
        ready = d / f"{name}.ready"
        log_path = d / f"{name}.log"
        cfg_path.write_text(json.dumps(runtime_cfg, indent=2))
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        argv = [sys.executable, "-m", "emulator.nvmetcp", "--config", str(cfg_path),
                "--ready-file", str(ready)]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        if busy_poll_us is not None:
            argv += ["--busy-poll", str(busy_poll_us)]
        rec = self._process_record(name, "userspace target", _listen_ports(runtime_cfg),
                                   config_text)
        rec.argv, rec.log = argv, str(log_path)
        rec.save()  # before the start: a kvtool killed from here on leaves a record
        env = rec.env()
        repo = str(Path(__file__).resolve().parents[2])  # so `-m emulator.nvmetcp` resolves
        env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        start_new_session=True, env=env)
        except OSError:
            rec.forget()
            raise
        procs.adopt(proc)
        rec.started(proc.pid)
        deadline = time.monotonic() + READY_TIMEOUT
        while not (ready.exists() and ready.stat().st_size > 0):
            if proc.poll() is not None:
                procs.reap(proc.pid)
                rec.forget()
                raise TargetError(f"the userspace target exited with status {proc.returncode}: "
                                  f"{_tail(log_path)}")
            if time.monotonic() > deadline:
                self._stop(proc.pid)
                raise TargetError(f"the userspace target did not report ready within "
                                  f"{READY_TIMEOUT:.0f} s: {_tail(log_path)}")
            time.sleep(0.05)
        self.pid = proc.pid
        rec.ready()
        text = ready.read_text().strip()
        self.extra = {"runtime_config": json.dumps(runtime_cfg), "log": str(log_path),
                      "ready": text}
        if metrics_port is not None:
            # the URL names the port the target bound (a free one when asked for 0)
            self.extra.update(metrics_port=metrics_port, metrics=json.loads(text).get("metrics"))
        if busy_poll_us is not None:
            self.extra["busy_poll_us"] = busy_poll_us

    def _stop(self, pid: int | None) -> None:
        stop_pid(pid)
        if pid == self.pid:
            self.pid = None

    def set_closed(self, cfg: TargetConfig, listeners: list[Listener]) -> None:
        """Fault injection: close ``listeners`` of the running target (their connections
        drop, new ones are refused) and reopen the others (the target's ``closed`` key,
        applied on SIGHUP)."""
        self._reconfigure(cfg, {"closed": [listen_address(lst) for lst in listeners]})

    def _reconfigure(self, cfg: TargetConfig, changes: dict[str, Any]) -> dict[str, Any]:
        """Rewrite the running target's config file with ``changes`` and SIGHUP it."""
        if not self._running() or self.record is None:
            raise TargetError(f"target {cfg.name!r} is not running (userspace runtime)")
        runtime_cfg = {**json.loads(self.record.extra.get("runtime_config", "{}")), **changes}
        path = st.run_dir() / f"{cfg.name}.userspace.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(runtime_cfg, indent=2))
        os.replace(tmp, path)
        self.extra["runtime_config"] = json.dumps(runtime_cfg)
        self.record.extra["runtime_config"] = self.extra["runtime_config"]
        os.kill(self.record.pid or 0, signal.SIGHUP)
        return runtime_cfg

    def set_ana(self, cfg: TargetConfig, lst: Listener, group: int, state: str) -> None:
        """Change one (listener, group) ANA state of the running target: rewrite its config
        file's ``ana`` and SIGHUP it, then read the state back through the listener."""
        if self.record is None:
            raise TargetError(f"target {cfg.name!r} is not running (userspace runtime)")
        ana = json.loads(self.record.extra.get("runtime_config", "{}")).get("ana", {})
        ana.setdefault(listen_address(lst), {})[str(group)] = state
        self._reconfigure(cfg, {"ana": ana})
        deadline = time.monotonic() + 10.0
        while (listener_ana(cfg, lst) or {}).get(group, "optimized") != state:
            if time.monotonic() > deadline:
                raise TargetError(f"the userspace target did not apply ANA state {state} to "
                                  f"group {group} on {listen_address(lst)}: "
                                  f"{_tail(Path(self.extra.get('log', '')))}")
            time.sleep(0.05)

    def status(self, cfg: TargetConfig) -> dict[str, Any]:
        running = self._running()
        subsystems = []
        for s in cfg.subsystems:
            namespaces = []
            for n in s.namespaces:
                size = n.size
                if n.backing != "memory" and n.path and os.path.exists(n.path):
                    from kvtool.target.nvmet.backend import backing_geometry
                    with contextlib.suppress(OSError):
                        size = max(backing_geometry(n.path)[0], n.size or 0)
                if size is not None:
                    size = size // n.block_size * n.block_size
                namespaces.append({"nsid": n.nsid, "enabled": running,
                                   "backing": n.path or "memory", "size": size,
                                   "block_size": n.block_size})
            if running and namespaces and cfg.listeners:
                # what the running target itself reports (Identify), not what we asked for
                live = _probe(cfg, cfg.listeners_of(s.nqn) or cfg.listeners, s)
                for ns in namespaces:
                    if ns["nsid"] in live:
                        ns["size"], ns["block_size"] = live[ns["nsid"]]
                    elif live:
                        ns["enabled"] = False
            listeners = [{"id": lst.id, "transport": "tcp", "address": lst.address,
                          "port": lst.port, "family": lst.family,
                          **({"ana": _ana_json(listener_ana(cfg, lst))} if running else {})}
                         for lst in cfg.listeners]
            subsystems.append({"nqn": s.nqn, "state": "up" if running else "absent",
                               "allow_any_host": s.allow_any_host, "hosts": list(s.hosts),
                               "namespaces": namespaces if running else [],
                               "listeners": listeners if running else []})
        return {"backend": self.name, "runtime": self.runtime,
                "pid": self.record.pid if running and self.record else None,
                "log": self.extra.get("log"),
                "metrics": self.extra.get("metrics") if running else None,
                "subsystems": subsystems}


def _ana_json(states: dict[int, str] | None) -> dict[str, str] | None:
    return {str(g): s for g, s in sorted(states.items())} if states is not None else None


def _probe(cfg: TargetConfig, listeners: Any, sub: Any) -> dict[int, tuple[int, int]]:
    from kvtool.target.probe import probe_namespaces
    lst = listeners[0]
    hostnqn = None if sub.allow_any_host else sub.hosts[0]
    try:
        return probe_namespaces(lst.address, lst.port, sub.nqn, hostnqn,
                                host=cfg.host(hostnqn) if hostnqn else None)
    except Exception:  # status must not fail because one probe did; the config values stand
        return {}


class KernelRuntime:
    """The host's own nvmet (configfs) on 127.0.0.1; memory namespaces live on /dev/shm."""

    name = "emulator"
    runtime = "kernel"
    SHM = "/dev/shm/kvtool"

    def __init__(self, root: str | None = None, *, backend: Any = None) -> None:
        from kvtool.target.nvmet.backend import NvmetBackend
        self.nvmet = backend or NvmetBackend(root)

    def host_config(self, cfg: TargetConfig) -> TargetConfig:
        return memory_as_files(cfg, self.SHM, "kernel")

    def plan_up(self, cfg: TargetConfig, previous: TargetConfig | None = None) -> Plan:
        prev = self.host_config(previous) if previous is not None else None
        plan = self.nvmet.plan_up(self.host_config(cfg), prev)
        plan.backend = self.name
        return plan

    def plan_down(self, cfg: TargetConfig) -> Plan:
        plan = self.nvmet.plan_down(self.host_config(cfg))
        plan.backend = self.name
        return plan

    def set_ana(self, cfg: TargetConfig, lst: Listener, group: int, state: str) -> None:
        self.nvmet.set_ana(self.host_config(cfg), lst, group, state)

    def status(self, cfg: TargetConfig) -> dict[str, Any]:
        return {**self.nvmet.status(self.host_config(cfg)), "backend": self.name,
                "runtime": self.runtime}


def recorded_pid_alive(pid: int | None, start: int | None = None) -> bool:
    """``pid`` is alive and is the recorded process: its start time is ``start`` (or that of
    the process record naming it); a reused pid is not."""
    if not pid or not st.pid_alive(pid):
        return False
    rec = procs.by_pid(pid)
    if start is None and rec is not None:
        start = rec.start_time
    return start is None or procs.start_time(pid) == start


def stop_pid(pid: int | None, timeout: float = STOP_TIMEOUT) -> None:
    """Stop the process ``pid`` started: through its record (:func:`procs.stop`: SIGTERM to
    its process group, SIGKILL after ``timeout``, every process with its token, the record
    removed); a pid without a record is signalled the same way. Raises ``TargetError`` when
    the process cannot be stopped."""
    rec = procs.by_pid(pid)
    if rec is not None:
        procs.stop(rec, timeout)
        return
    if not pid or not st.pid_alive(pid):
        procs.reap(pid)
        return
    legacy = procs.ProcessRecord(target="?", backend="emulator", runtime=None,
                                 role="process", pid=pid, start_time=procs.start_time(pid))
    procs.stop(legacy, timeout)


def config_json(cfg: TargetConfig) -> str:
    """``cfg`` as kvtool JSON (re-parsable): what a process record keeps for a later down."""
    from kvtool.target.document import config_document
    return json.dumps(config_document(cfg), indent=2)


def _listen_ports(runtime_cfg: dict[str, Any]) -> list[int]:
    return [int(str(a).rsplit(":", 1)[1]) for a in runtime_cfg.get("listen", [])]


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"
