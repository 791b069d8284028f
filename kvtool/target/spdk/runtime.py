"""The emulator's ``spdk`` runtime: SPDK's own ``nvmf_tgt``, started by kvtool on 127.0.0.1.

``kvtool target up CONFIG --runtime spdk`` (or ``[emulator] runtime = "spdk"``) starts
``nvmf_tgt --no-huge -m 0x1 --no-pci`` (SPDK from ``$KVTOOL_SPDK_DIR`` or the build of
``../shared/vendor/spdk``, :mod:`kvtool.target.spdk.install`) as a background process with a private RPC
socket, then configures it through the spdk backend: memory namespaces become malloc bdevs,
files AIO bdevs. The process outlives ``up``; its pid, socket and log are in the target's
state record, so ``status`` (SPDK's own view), ``load``/``replay`` (the endpoints) and
``down`` (which stops it) find it. While it runs, a changed config is applied by the spdk
backend's incremental plan.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtool.errors import InputError
from kvtool.target.config import TargetConfig
from kvtool.target.emulator import BackgroundRuntime, config_json, stop_pid
from kvtool.target.plan import Plan, TargetError
from kvtool.target.spdk.backend import SpdkBackend, spdk_config
from kvtool.target.spdk.rpc import SpdkRpc, require_client

CPUMASK = "0x1"
BASE_MEM_MB = 1024  # DPDK memory beyond the malloc bdevs (buffers, pools); touched lazily
_READS = ("nvmf_get_transports", "nvmf_get_subsystems", "bdev_get_bdevs",
          "bdev_nvme_get_controllers", "keyring_get_keys")


class _NotStartedRpc(SpdkRpc):
    """The RPC of an nvmf_tgt that a plan is about to start: at plan time reads answer as
    a fresh target would; once started, every call goes to it."""

    def __init__(self, socket_path: str, timeout: float, version: dict[str, Any]) -> None:
        super().__init__(socket_path, timeout)
        self.version = version
        self.started = False

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        if not self.started:
            if method == "spdk_get_version":
                return self.version
            if method in _READS:
                return []
        return super().call(method, params)


def memory_mb(cfg: TargetConfig) -> int:
    return BASE_MEM_MB + sum((ns.size or 0) >> 20 for s in cfg.subsystems
                             for ns in s.namespaces if ns.backing == "memory")


def _install() -> Any:
    from kvtool.target.spdk.install import SpdkNotFound, find_spdk
    try:
        return find_spdk(build=False)
    except SpdkNotFound as exc:
        raise InputError(f"the spdk runtime needs SPDK: {exc}", field="runtime") from None


class SpdkRuntime(BackgroundRuntime):
    """nvmf_tgt as the emulator's target, configured through :class:`SpdkBackend`."""

    runtime = "spdk"

    def _backend(self, cfg: TargetConfig) -> SpdkBackend:
        return SpdkBackend(socket_path=self.extra["spdk_socket"], timeout=cfg.spdk_timeout)

    def plan_up(self, cfg: TargetConfig, previous: TargetConfig | None = None) -> Plan:
        if self._running():
            plan = self._backend(cfg).plan_up(cfg, previous)
            plan.backend = self.name
            return plan
        require_client()
        install = _install()
        # short (a Unix socket path has 107 bytes), created only when the plan runs
        workdir = Path(tempfile.gettempdir()) / f"kvtool-spdk-{uuid.uuid4().hex[:10]}"
        rpc = _NotStartedRpc(str(self._socket(cfg, workdir)), cfg.spdk_timeout,
                             install.version())
        inner = SpdkBackend(rpc).plan_up(cfg)
        plan = Plan(self.name, "up")
        mem = self._memory(cfg)
        self._plan_devices(cfg, plan)

        def start() -> None:
            self._start(cfg, install, workdir, mem)
            rpc.started = True

        def stop() -> None:
            self._stop(self.pid)
            shutil.rmtree(workdir, ignore_errors=True)

        pci = " ".join(f"-A {bdf}" for bdf in self._pci(cfg)) or "--no-pci"
        plan.add("start", "process", "nvmf_tgt",
                 f"--no-huge -s {mem} -m {self._cpumask(cfg)} {pci}, RPC {rpc.socket_path}",
                 start, stop)
        for step in inner.steps:
            if step.undo is None:  # a transport: it goes with the process
                step.undo = lambda: None
            plan.steps.append(step)
        plan.notes.extend(n for n in inner.notes if "SPDK has no RPC to delete" not in n)
        return plan

    # what the emulator's runtime starts; ManagedSpdk (the spdk backend, start = true) differs
    def _cpumask(self, cfg: TargetConfig) -> str:
        return CPUMASK

    def _memory(self, cfg: TargetConfig) -> int:
        return memory_mb(cfg)

    def _pci(self, cfg: TargetConfig) -> tuple[str, ...]:
        return ()

    def _socket(self, cfg: TargetConfig, workdir: Path) -> Path:
        return workdir / "spdk.sock"

    def _plan_devices(self, cfg: TargetConfig, plan: Plan) -> None:
        """Steps before the start (ManagedSpdk: hand the PCIe controllers to SPDK)."""

    def _start(self, cfg: TargetConfig, install: Any, workdir: Path, mem: int,
               config: Path | None = None) -> None:
        from kvtool.target.spdk.app import SpdkApp, SpdkAppError, trace_file
        workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        rec = self._process_record(cfg.name, "nvmf_tgt", [lst.port for lst in cfg.listeners],
                                   config_json(cfg))
        rec.workdir = str(workdir)
        app = SpdkApp(install, "nvmf_tgt", cpumask=self._cpumask(cfg), mem_mb=mem,
                      workdir=workdir, config=config, env=rec.env({}),
                      pci_allowed=self._pci(cfg), socket=self._socket(cfg, workdir))
        rec.argv, rec.sockets, rec.log = app.command(), [str(app.socket)], str(app.log_path)
        rec.save()  # before the start: a kvtool killed from here on leaves a record
        try:
            app.start(on_spawn=lambda pid: rec.started(pid, leftovers=[trace_file("nvmf_tgt",
                                                                                   pid)]))
        except SpdkAppError as exc:
            rec.forget()  # SpdkApp.start stopped what it started
            raise TargetError(str(exc)) from None
        except BaseException:
            rec.forget()
            raise
        rec.ready()
        self.pid = app.pid
        self.extra = {"spdk_socket": str(app.socket), "spdk_dir": str(workdir),
                      "spdk_root": str(install.root), "log": str(app.log_path),
                      "mem_mb": mem}

    def _stop(self, pid: int | None) -> None:
        sock = self.extra.get("spdk_socket")
        if pid and sock and Path(sock).exists():
            with contextlib.suppress(Exception), SpdkRpc(sock, timeout=5) as rpc:
                rpc.call("spdk_kill_instance", {"sig_name": "SIGTERM"})
        stop_pid(pid)
        if pid == self.pid:
            self.pid = None

    def plan_down(self, cfg: TargetConfig) -> Plan:
        plan = Plan(self.name, "down")
        if not self._running():
            plan.notes.append("no nvmf_tgt is running for this config")
            return plan
        assert self.record is not None
        pid, workdir = self.record.pid, Path(self.extra["spdk_dir"])
        previous = dict(self.extra)

        def stop() -> None:
            self._stop(pid)
            shutil.rmtree(workdir, ignore_errors=True)

        def restart() -> None:  # the config as SPDK's JSON: the same state in one start
            from kvtool.target.spdk.install import SpdkInstall
            workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
            saved = workdir / "restore.json"
            saved.write_text(json.dumps(spdk_config(cfg)))
            self._start(cfg, SpdkInstall(Path(previous["spdk_root"])), workdir,
                        int(previous.get("mem_mb", memory_mb(cfg))), config=saved)

        plan.add("stop", "process", f"nvmf_tgt pid {pid}", "spdk_kill_instance SIGTERM",
                 stop, restart)
        return plan

    def set_ana(self, cfg: TargetConfig, lst: Any, group: int, state: str) -> None:
        """Change a listener's ANA state in the running nvmf_tgt (the spdk backend's RPC)."""
        if not self._running():
            raise TargetError(f"no nvmf_tgt is running for target {cfg.name!r}")
        self._backend(cfg).set_ana(cfg, lst, group, state)

    def status(self, cfg: TargetConfig) -> dict[str, Any]:
        if not self._running():
            return {"backend": self.name, "runtime": self.runtime, "pid": None,
                    "subsystems": [{"nqn": s.nqn, "state": "absent", "namespaces": [],
                                    "listeners": [], "hosts": [], "allow_any_host": False}
                                   for s in cfg.subsystems]}
        assert self.record is not None
        live = self._backend(cfg).status(cfg)
        return {**live, "backend": self.name, "runtime": self.runtime, "pid": self.record.pid,
                "log": self.extra.get("log")}


def _call(fn: Callable[..., object], *args: Any) -> Callable[[], None]:
    def run() -> None:
        fn(*args)
    return run


class ManagedSpdk(SpdkRuntime):
    """The spdk backend with ``[spdk] start = true``: kvtool starts ``nvmf_tgt`` itself, as the
    emulator's spdk runtime does, but for the production shape: any transport (RDMA), and
    namespaces on PCIe NVMe controllers that ``up`` hands to SPDK's userspace driver
    (``[spdk] pci_driver``, default vfio-pci; :mod:`kvtool.target.spdk.pci`) before the start
    and ``down`` gives back to the kernel's ``nvme`` driver after the stop. No hugepages:
    ``--no-huge -s [spdk] mem_mb`` (vfio-pci then needs an IOMMU)."""

    name = "spdk"
    runtime = "nvmf_tgt"

    def _cpumask(self, cfg: TargetConfig) -> str:
        return cfg.spdk_cpumask or CPUMASK

    def _memory(self, cfg: TargetConfig) -> int:
        return cfg.spdk_mem_mb or memory_mb(cfg)

    def _pci(self, cfg: TargetConfig) -> tuple[str, ...]:
        return tuple(cfg.pci_controllers())

    def _socket(self, cfg: TargetConfig, workdir: Path) -> Path:
        return Path(cfg.spdk_socket) if cfg.spdk_socket else workdir / "spdk.sock"

    def _plan_devices(self, cfg: TargetConfig, plan: Plan) -> None:
        from kvtool.target.spdk import pci
        drv = cfg.spdk_pci_driver
        for bdf in self._pci(cfg):
            now = pci.driver(bdf) if pci.exists(bdf) else None
            if now == drv:
                plan.notes.append(f"PCI {bdf} is already bound to {drv}")
                continue
            plan.add("bind", "pci", bdf, f"{now or 'no driver'} -> {drv} (driver_override, "
                     "drivers_probe)", _call(pci.bind, bdf, drv), _call(pci.release, bdf))

    def plan_down(self, cfg: TargetConfig) -> Plan:
        from kvtool.target.spdk import pci
        if self._running():
            plan = super().plan_down(cfg)
        else:
            plan = Plan(self.name, "down")
            plan.notes.append("no nvmf_tgt is running for this config")
        drv = cfg.spdk_pci_driver
        for bdf in self._pci(cfg):
            now = pci.driver(bdf) if pci.exists(bdf) else None
            if now != drv:
                continue
            plan.add("release", "pci", bdf, f"{drv} -> nvme (driver_override cleared, "
                     "drivers_probe)", _call(pci.release, bdf), _call(pci.bind, bdf, drv))
        return plan

    def status(self, cfg: TargetConfig) -> dict[str, Any]:
        from kvtool.target.spdk import pci
        doc = super().status(cfg)
        doc["pci"] = [{"traddr": bdf, "driver": pci.driver(bdf) if pci.exists(bdf) else None}
                      for bdf in self._pci(cfg)]
        return doc
