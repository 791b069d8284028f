"""The emulator's ``qemu`` runtime: the real Linux nvmet in a QEMU guest, on 127.0.0.1.

For hosts whose kernel lacks nvmet. A supervisor process (``python -m
kvtool.target.guest``) boots the guest (:class:`emulator.qemu.guest.Guest`: TCG,
``restrict=on`` network, host root shared read-only over 9p) with one ``hostfwd`` per
listener, then runs **kvtool itself inside the guest** (``chroot /hostroot``, the host's
own Python and kvtool) as ``kvtool target up --backend nvmet``: the guest kernel's configfs
is configured by exactly the same :class:`~kvtool.target.nvmet.backend.NvmetBackend` code
as a real host's. The supervisor stays in the background holding the guest; SIGTERM makes
it run ``kvtool target down`` in the guest (real teardown on the real kernel) and stop QEMU.

Inside the guest the namespaces live in the guest: a ``memory`` namespace becomes a file on
the guest's tmpfs served with ``buffered_io`` (4096-byte LBAs); ``file``/``block`` paths
name guest paths. Listeners bind 0.0.0.0 in the guest (reachable only through the
forwards) and are reported at 127.0.0.1:<port> on the host.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtool.target import procs
from kvtool.target import state as st
from kvtool.target.config import TargetConfig
from kvtool.target.document import config_document
from kvtool.target.emulator import BackgroundRuntime, config_json, memory_as_files, stop_pid
from kvtool.target.plan import Plan, TargetError

_log = logging.getLogger(__name__)
"""The supervisor's log: what the guest's kvtool printed, and why it stopped (:func:`main`
sends it to the process's log file; the library itself never prints)."""
BOOT_TIMEOUT = 300.0  # TCG boot + Python start in the guest on a loaded 2-core machine
GUEST_DIR = "/run/kvtool"  # the guest's own tmpfs, bound into the chroot (emulator/qemu/init.sh)
REPO = Path(__file__).resolve().parents[2]


def guest_config(cfg: TargetConfig) -> TargetConfig:
    """``cfg`` as the guest's nvmet backend runs it (guest paths, 0.0.0.0 listeners)."""
    files = memory_as_files(cfg, GUEST_DIR, "qemu")
    listeners = tuple(replace(lst, address="0.0.0.0" if lst.family == "ipv4" else "::")
                      for lst in cfg.listeners)
    return replace(files, backend="nvmet", runtime="auto", listeners=listeners, source=None,
                   locator=None)


def guest_exec(control_port: int, shell: str, timeout: float = 120.0) -> tuple[int, str]:
    """Run ``shell`` in the guest over its control channel; a dead channel is a TargetError."""
    from emulator.qemu.guest import guest_exec as exec_in_guest
    try:
        return exec_in_guest(control_port, shell, timeout=timeout)
    except ConnectionError as exc:
        raise TargetError(str(exc)) from exc


def kvtool_in_guest(args: str) -> str:
    """The shell line that runs this very kvtool inside the guest's chroot of the host root."""
    env = f"KVTOOL_STATE_DIR={GUEST_DIR}/state PYTHONPATH={REPO} HOME=/tmp"
    return f"chroot /hostroot /usr/bin/env {env} {sys.executable} -m kvtool.cli.target_alone {args}"


def json_tail(text: str) -> Any:
    """The JSON document at the end of mixed output (kvtool prints it last on stdout)."""
    start = text.find("{")
    while start != -1:
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    raise TargetError(f"no JSON in the guest's output: {text[-500:]}")


class QemuRuntime(BackgroundRuntime):
    """Host side of the qemu runtime: starts/stops the supervisor, asks the guest for status."""

    runtime = "qemu"

    def plan_up(self, cfg: TargetConfig, previous: TargetConfig | None = None) -> Plan:
        plan = Plan(self.name, "up")
        gcfg = guest_config(cfg)
        if self._running():
            assert self.record is not None
            if self.record.digest == cfg.digest():
                return plan
            pid = self.record.pid
            plan.add("stop", "process", f"pid {pid}", "QEMU guest with the old config",
                     lambda: self._stop(pid), None)
        ports = ", ".join(f"127.0.0.1:{lst.port}" for lst in cfg.listeners)
        nss = sum(len(s.namespaces) for s in cfg.subsystems)
        plan.add("start", "process", "QEMU guest (real Linux nvmet)",
                 f"hostfwd {ports}; in the guest: kvtool target up --backend nvmet "
                 f"({len(cfg.subsystems)} subsystem(s), {nss} namespace(s))",
                 lambda: self._start(cfg, gcfg), lambda: self._stop(self.pid))
        plan.notes.append("the guest's own plan is shown in the state record (extra.guest_plan)")
        return plan

    def _start(self, cfg: TargetConfig, gcfg: TargetConfig) -> None:
        d = st.run_dir()
        d.mkdir(parents=True, exist_ok=True)
        spec = {"name": cfg.name, "config": config_document(gcfg),
                "forwards": {str(lst.port): lst.port for lst in cfg.listeners},
                # DH-HMAC-CHAP needs the 6.12 guest (6.1 has no NVMe authentication)
                "kernel": "6.12" if cfg.host_keys() else "6.1"}
        spec_path = d / f"{cfg.name}.qemu.json"
        ready = d / f"{cfg.name}.ready"
        log_path = d / f"{cfg.name}.log"
        spec_path.write_text(json.dumps(spec, indent=2))
        ready.unlink(missing_ok=True)
        rec = self._process_record(cfg.name, "QEMU supervisor",
                                   [lst.port for lst in cfg.listeners], config_json(cfg))
        rec.argv = [sys.executable, "-m", "kvtool.target.guest", str(spec_path), str(ready)]
        rec.log = str(log_path)
        rec.save()  # before the start: a kvtool killed from here on leaves a record
        env = rec.env()  # QEMU, started by the supervisor, carries the token too
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(rec.argv, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=log, start_new_session=True, env=env)
        except OSError:
            rec.forget()
            raise
        procs.adopt(proc)
        rec.started(proc.pid)
        deadline = time.monotonic() + BOOT_TIMEOUT + 60
        while not (ready.exists() and ready.stat().st_size > 0):
            if proc.poll() is not None:
                procs.stop(rec)  # QEMU, should it outlive its supervisor
                raise TargetError(f"the QEMU guest supervisor exited ({proc.returncode}): "
                                  f"{_tail(log_path)}")
            if time.monotonic() > deadline:
                procs.stop(rec)
                raise TargetError(f"the QEMU guest did not come up: {_tail(log_path)}")
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        if info.get("error"):
            procs.stop(rec, timeout=120.0)
            raise TargetError(f"in the guest, kvtool target up failed: {info['error']}")
        rec.ready()
        self.pid = proc.pid
        self.extra = {"control_port": info["control_port"], "forwards": info["forwards"],
                      "log": str(log_path), "boot_seconds": info.get("boot_seconds"),
                      "guest_plan": info.get("plan")}

    def _stop(self, pid: int | None) -> None:
        stop_pid(pid, timeout=120.0)
        if pid == self.pid:
            self.pid = None

    def plan_down(self, cfg: TargetConfig) -> Plan:
        plan = Plan(self.name, "down")
        if not self._running():
            plan.notes.append("no QEMU guest is running for this config")
            return plan
        assert self.record is not None
        pid = self.record.pid
        plan.add("stop", "process", f"pid {pid}",
                 "in the guest: kvtool target down (real configfs teardown); then stop QEMU",
                 lambda: self._stop(pid), None)
        return plan

    def set_ana(self, cfg: TargetConfig, lst: Any, group: int, state: str) -> None:
        """``kvtool target ana`` inside the guest, on the guest's listener (0.0.0.0:PORT)."""
        if not self._running():
            raise TargetError(f"no QEMU guest is running for target {cfg.name!r}")
        addr = "[::]" if lst.family == "ipv6" else "0.0.0.0"
        rc, out = guest_exec(int(self.extra["control_port"]), kvtool_in_guest(
            f"--json ana --name {cfg.name} --listener {addr}:{lst.port} --group {group} "
            f"--state {state}"), timeout=60)
        if rc != 0:
            raise TargetError(f"in the guest, kvtool target ana failed: "
                              f"{out.strip().splitlines()[-1] if out.strip() else rc}")

    def status(self, cfg: TargetConfig) -> dict[str, Any]:
        running = self._running()
        if not running:
            return {"backend": self.name, "runtime": self.runtime, "pid": None, "subsystems": [
                {"nqn": s.nqn, "state": "absent", "namespaces": [], "listeners": [], "hosts": [],
                 "allow_any_host": False} for s in cfg.subsystems]}
        _rc, out = guest_exec(int(self.extra["control_port"]),
                             kvtool_in_guest(f"--json status --name {cfg.name}"))
        doc = json_tail(out)
        forwards = {int(k): int(v) for k, v in self.extra.get("forwards", {}).items()}
        for sub in doc["subsystems"]:
            for lst in sub["listeners"]:
                lst["guest_address"] = lst["address"]
                lst["address"] = "127.0.0.1"
                lst["port"] = forwards.get(int(lst["port"]), lst["port"])
                lst["family"] = "ipv4"
        return {"backend": self.name, "runtime": self.runtime,
                "pid": self.record.pid if self.record else None,
                "log": self.extra.get("log"), "guest_configfs": "/sys/kernel/config/nvmet (guest)",
                "subsystems": doc["subsystems"]}


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def _supervise(spec_path: str, ready_path: str) -> int:
    """The background process: boot, configure in the guest, wait for SIGTERM, tear down."""
    from emulator.qemu.guest import Guest
    spec = json.loads(Path(spec_path).read_text())
    forwards = {int(k): int(v) for k, v in spec["forwards"].items()}
    stop = threading.Event()
    serving = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()
        if not serving.is_set():  # still booting: give up now (finally stops the guest)
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def report(doc: dict[str, Any]) -> None:
        tmp = ready_path + ".tmp"
        Path(tmp).write_text(json.dumps(doc))
        os.replace(tmp, ready_path)

    from emulator.qemu.build import ensure_built
    guest = Guest(ensure_built(kernel=spec.get("kernel", "6.1")), target=False, hostroot=True,
                  forwards=forwards, boot_timeout=BOOT_TIMEOUT, mem_mb=512)
    try:
        guest.start()
        doc = json.dumps(spec["config"])
        rc, out = guest.exec(f"mkdir -p {GUEST_DIR}/state && cat > {GUEST_DIR}/target.json "
                             f"<<'KVTOOL_EOF'\n{doc}\nKVTOOL_EOF", timeout=30)
        if rc != 0:
            raise TargetError(f"cannot write the config into the guest: {out.strip()}")
        rc, out = guest.exec(kvtool_in_guest(
            f"--json up {GUEST_DIR}/target.json --backend nvmet --allow-remote"),
            timeout=BOOT_TIMEOUT)
        _log.info("%s", out)
        if rc != 0:
            report({"error": out.strip().splitlines()[-1] if out.strip() else f"exit {rc}"})
            return 1
        result = json_tail(out)
        report({"pid": os.getpid(), "control_port": guest.control_port,
                "forwards": {str(g): guest.host_port(g) for g in forwards},
                "boot_seconds": guest.boot_seconds, "plan": result.get("plan")})
        serving.set()
        while not stop.wait(1.0):
            if not guest.running:
                _log.error("kvtool: the QEMU guest died")
                return 1
        rc, out = guest.exec(kvtool_in_guest(f"--json down --name {spec['name']}"),
                             timeout=120)
        _log.info("%s", out)
        return 0 if rc == 0 else 1
    except Exception as exc:
        _log.error("kvtool: %s: %s", type(exc).__name__, exc)
        if not Path(ready_path).exists():
            report({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
        return 1
    finally:
        guest.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtool.target.guest",
                                description="Supervisor of the emulator's QEMU guest "
                                            "(started by kvtool target up --runtime qemu).")
    p.add_argument("spec")
    p.add_argument("ready")
    a = p.parse_args(argv)
    _log.addHandler(logging.StreamHandler())  # stderr: the supervisor's log file
    _log.setLevel(logging.INFO)
    return _supervise(a.spec, a.ready)


if __name__ == "__main__":
    sys.exit(main())
