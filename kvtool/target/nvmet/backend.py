"""The kernel nvmet backend: diff a :class:`~kvtool.target.config.TargetConfig` against
configfs and plan the changes in the order the kernel requires (docs/target.md; Linux
drivers/nvme/target/configfs.c).

Ownership: the config owns its subsystems (by NQN), its ports (by listener id) and the
hosts it names. ``up`` creates or corrects exactly those; ``down`` removes exactly those,
leaving anything else in configfs alone (a host still allowed by a foreign subsystem stays).

Errno-aware ordering, so the kernel never has to say no:
* a namespace's ``device_path``/``buffered_io`` change is wrapped in enable=0 … enable=1
  (EBUSY/EINVAL while enabled);
* a port's ``addr_*``/``param_*`` change unlinks its subsystems first and relinks them
  after (EACCES while enabled);
* ``allow_any_host=1`` is written only after explicit host links are removed, and host
  links only after ``allow_any_host=0`` (EINVAL otherwise);
* teardown: port links → ports → namespaces → allowed_hosts → subsystems → hosts
  (EBUSY/ENOTEMPTY otherwise).
Every step carries an undo built from a snapshot taken while planning, so a failure
half-way rolls the tree back to what it was.
"""

from __future__ import annotations

import fcntl
import math
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvtool.errors import InputError
from kvtool.target.config import Listener, Namespace, Subsystem, TargetConfig
from kvtool.target.nvmet.configfs import DEFAULT_ROOT, ConfigFS, Port, Root
from kvtool.target.plan import Plan, TargetError

BLKSSZGET = 0x1268
MODULES = {"tcp": "nvmet-tcp", "rdma": "nvmet-rdma"}
PORT_ADDR_ORDER = ("trtype", "adrfam", "traddr", "trsvcid", "treq", "tsas")


def _noop() -> None:
    """Undo of a write into an object this run created: removing the object undoes it."""


def backing_geometry(path: str) -> tuple[int, int]:
    """(bytes, LBA size) the kernel target serves for a block device or file.

    Block device: its size and logical block size. File: nvmet uses
    ``1 << min(i_blkbits, 12)`` (io-cmd-file.c) and serves whole LBAs only.
    """
    st = os.stat(path)
    if stat.S_ISBLK(st.st_mode):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            lba = int.from_bytes(fcntl.ioctl(fd, BLKSSZGET, bytes(4)), "little")
        finally:
            os.close(fd)
        return size, lba
    blksize = getattr(st, "st_blksize", 4096) or 4096
    blkbits = int(math.log2(blksize))
    lba = 1 << min(blkbits, 12)
    return st.st_size // lba * lba, lba


class NvmetBackend:
    """Plans and reads kernel nvmet state through configfs."""

    name = "nvmet"

    def __init__(self, root: str | os.PathLike[str] | None = None, *,
                 manage_modules: bool | None = None, cfs: ConfigFS | None = None) -> None:
        self.cfs = cfs or ConfigFS(root or DEFAULT_ROOT)
        self.root = Root(self.cfs)
        # Modules are loaded only for the real tree; a test or guest tree is taken as given.
        self.manage_modules = (str(self.cfs.root) == DEFAULT_ROOT
                               if manage_modules is None else manage_modules)

    # ---------------------------------------------------------------- modules
    def _module_steps(self, plan: Plan, cfg: TargetConfig) -> None:
        wanted = ["nvmet", *sorted({MODULES[lst.transport] for lst in cfg.listeners})]
        if not self.manage_modules:
            if not self.root.exists:
                raise TargetError(f"nvmet configfs not found at {self.cfs.root} (is the nvmet "
                                  "module loaded and configfs mounted?)")
            return
        missing = [m for m in wanted if not Path("/sys/module", m.replace("-", "_")).exists()]
        if missing or not self.root.exists:
            plan.add("load", "module", " ".join(missing or ["nvmet"]),
                     "modprobe; mount configfs if needed", partial(self._load, missing), _noop)

    def _load(self, modules: list[str]) -> None:
        modprobe = shutil.which("modprobe") or "/sbin/modprobe"
        for mod in modules:
            r = subprocess.run([modprobe, mod], capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise TargetError(f"modprobe {mod} failed: {r.stderr.strip() or r.returncode} "
                                  "(this kernel may lack CONFIG_NVME_TARGET; use the emulator "
                                  "backend, which falls back to a QEMU guest)")
        cfg_dir = self.cfs.root.parent
        if not self.root.exists and cfg_dir.is_dir() and not any(cfg_dir.iterdir()):
            subprocess.run(["mount", "-t", "configfs", "none", str(cfg_dir)], check=False,
                           capture_output=True)
        if not self.root.exists:
            raise TargetError(f"nvmet configfs not found at {self.cfs.root} after loading modules")

    # ---------------------------------------------------------------- snapshots (for undo)
    def _snap_ns(self, nqn: str, nsid: int) -> dict[str, str]:
        ns = self.root.subsystem(nqn).namespace(nsid)
        snap = {a: ns.get(a) or "" for a in ("device_path", "device_uuid", "device_nguid")}
        if ns.has("buffered_io"):
            snap["buffered_io"] = ns.get("buffered_io") or "0"
        snap["enable"] = "1" if ns.enabled else "0"
        return snap

    def _restore_ns(self, nqn: str, nsid: int, snap: dict[str, str]) -> None:
        ns = self.root.subsystem(nqn).namespace(nsid)
        if not ns.exists:
            ns.create()
        elif ns.enabled:
            ns.set("enable", "0")
        for attr in ("device_path", "device_uuid", "device_nguid", "buffered_io"):
            if snap.get(attr):
                ns.set(attr, snap[attr])
        if snap.get("enable") == "1":
            ns.set("enable", "1")

    def _snap_port(self, port: Port) -> dict[str, Any]:
        return {"addr": port.attrs("addr"), "param": port.attrs("param"),
                "links": port.subsystems()}

    def _restore_port(self, portid: int, snap: dict[str, Any], links: bool = True) -> None:
        port = self.root.port(portid)
        if not port.exists:
            port.create()
        for key in PORT_ADDR_ORDER:
            if key in snap["addr"]:
                port.set(f"addr_{key}", snap["addr"][key])
        for key, value in snap["param"].items():
            if port.has(f"param_{key}"):
                port.set(f"param_{key}", value)
        if links:
            for nqn in snap["links"]:
                if nqn not in port.subsystems():
                    port.link(nqn)

    def _snap_subsys(self, nqn: str) -> dict[str, str]:
        s = self.root.subsystem(nqn)
        return {a: s.get(f"attr_{a}") or "" for a in ("allow_any_host", "serial", "model")}

    def _restore_subsys(self, nqn: str, snap: dict[str, str]) -> None:
        s = self.root.subsystem(nqn)
        if not s.exists:
            s.create()
        for a in ("serial", "model", "allow_any_host"):
            if snap.get(a):
                s.set(f"attr_{a}", snap[a])

    # ---------------------------------------------------------------- up
    def plan_up(self, cfg: TargetConfig, previous: TargetConfig | None = None) -> Plan:
        """Steps that turn configfs into ``cfg`` (empty when it already matches)."""
        plan = Plan(self.name, "up")
        self._module_steps(plan, cfg)
        live = self.root.exists
        self._check_lba(cfg)
        if live:
            self._check_port_clash(cfg)
        if previous is not None and live:
            self._plan_removed(plan, cfg, previous)

        # Unlinks first: hosts about to be disallowed, subsystems leaving a port.
        for sub in cfg.subsystems:
            s = self.root.subsystem(sub.nqn)
            if live and s.exists:
                for h in s.allowed_hosts():
                    if sub.allow_any_host or h not in sub.hosts:
                        plan.add("unlink", "allowed_host", f"{s.rel}/allowed_hosts/{h}",
                                 "not in config", partial(s.disallow_host, h),
                                 partial(s.allow_host, h))

        for host in cfg.all_host_nqns():
            self._plan_host(plan, cfg, host, live)
        for sub in cfg.subsystems:
            self._plan_subsystem(plan, sub, live)
        for lst in cfg.listeners:
            self._plan_port(plan, lst, cfg, live)
        return plan

    def _check_lba(self, cfg: TargetConfig) -> None:
        for si, sub in enumerate(cfg.subsystems):
            for ni, ns in enumerate(sub.namespaces):
                if ns.lba is None or ns.path is None or not os.path.exists(ns.path):
                    continue
                _, lba = backing_geometry(ns.path)
                if lba != ns.lba:
                    file, line = cfg.where("subsystem", si, "namespace", ni, "lba")
                    raise InputError(f"nvmet serves {ns.path} with {lba}-byte LBAs (the kernel "
                                     f"takes it from the backing); lba = {ns.lba} cannot be "
                                     "honoured", file=file, line=line,
                                     field=f"subsystem[{si}].namespace[{ni}].lba")

    def _check_port_clash(self, cfg: TargetConfig) -> None:
        mine = {lst.id for lst in cfg.listeners}
        for lst in cfg.listeners:
            for port in self.root.ports():
                if port.portid in mine or not port.enabled:
                    continue
                a = port.address()
                if (a.get("trtype") == lst.transport and a.get("traddr") == lst.address
                        and a.get("trsvcid") == str(lst.port)):
                    raise TargetError(f"port clash: ports/{port.portid} (not in this config) "
                                      f"already listens on {lst.transport} "
                                      f"{lst.address}:{lst.port}")

    def _plan_removed(self, plan: Plan, cfg: TargetConfig, previous: TargetConfig) -> None:
        """Objects the previous config owned and this one dropped are torn down first."""
        gone_ports = [lst for lst in previous.listeners if lst.id not in {x.id for x in cfg.listeners}]
        gone_subs = [s for s in previous.subsystems if cfg.subsystem(s.nqn) is None]
        if gone_ports or gone_subs:
            stale = TargetConfig(name=previous.name, backend=previous.backend,
                                 subsystems=tuple(gone_subs), listeners=tuple(gone_ports),
                                 hosts=())
            keep_hosts = set(cfg.all_host_nqns())
            down = self.plan_down(stale, keep_hosts=keep_hosts)
            plan.steps.extend(down.steps)

    def _plan_host(self, plan: Plan, cfg: TargetConfig, nqn: str, live: bool) -> None:
        h = self.root.host(nqn)
        exists = live and h.exists
        if not exists:
            plan.add("create", "host", h.rel, "", h.create, h.delete)
        spec = cfg.host(nqn)
        if spec is None or spec.dhchap_key_file is None:
            return
        # nvmet keeps one hash and one DH group per host: the first of each list
        hashes, groups = spec.dhchap_hashes, spec.dhchap_dhgroups
        if len(hashes) > 1 or len(groups) > 1:
            plan.notes.append(f"hosts/{nqn}: nvmet allows one hash and one DH group per host; "
                              f"using {hashes[0] if hashes else 'sha256'} and "
                              f"{groups[0] if groups else 'null'} (the first listed)")
        wants: list[tuple[str, str, str]] = [
            ("dhchap_key", read_secret(spec.dhchap_key_file),
             f"DH-HMAC-CHAP secret from {spec.dhchap_key_file}")]
        if spec.dhchap_ctrl_key_file:
            wants.append(("dhchap_ctrl_key", read_secret(spec.dhchap_ctrl_key_file),
                          f"DH-HMAC-CHAP controller secret from {spec.dhchap_ctrl_key_file}"))
        wants.append(("dhchap_hash", f"hmac({hashes[0] if hashes else 'sha256'})", ""))
        wants.append(("dhchap_dhgroup", groups[0] if groups else "null", ""))
        for attr, want, label in wants:
            have = h.get(attr) if exists else None
            if (have or "").strip() != want:
                plan.add("update", "host", f"{h.rel}/{attr}", label or want,
                         partial(_set_auth, h, attr, want),
                         partial(h.set, attr, have or "") if exists and have else _noop)

    def _plan_subsystem(self, plan: Plan, sub: Subsystem, live: bool) -> None:
        s = self.root.subsystem(sub.nqn)
        exists = live and s.exists
        if not exists:
            plan.add("create", "subsystem", s.rel, f"{len(sub.namespaces)} namespace(s)",
                     s.create, s.delete)
        # serial/model before anything can identify the controller (EINVAL afterwards).
        for attr, want in (("serial", sub.serial), ("model", sub.model)):
            if want is None:
                continue
            have = s.get(f"attr_{attr}") if exists else None
            if (have or "").strip() != want:
                plan.add("update", "subsystem", f"{s.rel}/attr_{attr}", repr(want),
                         partial(s.set, f"attr_{attr}", want),
                         partial(s.set, f"attr_{attr}", have or "")
                         if exists else _noop)

        if exists:
            for ns in s.namespaces():
                if sub.namespace(ns.nsid) is None:
                    self._plan_ns_delete(plan, sub.nqn, ns.nsid, "not in config")
        for ns_spec in sub.namespaces:
            self._plan_namespace(plan, sub, ns_spec, exists)

        want_any = "1" if sub.allow_any_host else "0"
        have_any = ("1" if s.allow_any_host else "0") if exists else "0"
        if want_any != have_any:
            plan.add("update", "subsystem", f"{s.rel}/attr_allow_any_host", want_any,
                     partial(s.set, "attr_allow_any_host", want_any),
                     partial(s.set, "attr_allow_any_host", have_any))
        have_hosts = set(s.allowed_hosts()) if exists else set()
        for h in sub.hosts:
            if h not in have_hosts:
                plan.add("link", "allowed_host", f"{s.rel}/allowed_hosts/{h}", "",
                         partial(s.allow_host, h), partial(s.disallow_host, h))

    def _plan_namespace(self, plan: Plan, sub: Subsystem, spec: Namespace, sub_exists: bool) -> None:
        ns = self.root.subsystem(sub.nqn).namespace(spec.nsid)
        assert spec.path is not None
        if spec.create and not os.path.exists(spec.path):
            size = spec.size or 0
            plan.add("create", "file", spec.path, f"{size} bytes, sparse",
                     partial(create_file, spec.path, size),
                     partial(os.unlink, spec.path))
        want = {"device_path": spec.path}
        if spec.uuid:
            want["device_uuid"] = spec.uuid
        if spec.nguid:
            want["device_nguid"] = spec.nguid
        if not (sub_exists and ns.exists):
            plan.add("create", "namespace", ns.rel, spec.path, ns.create, ns.delete)
            for attr, value in want.items():
                plan.add("update", "namespace", f"{ns.rel}/{attr}", value,
                         partial(ns.set, attr, value), _noop)
            if spec.ana_group is not None:
                plan.add("update", "namespace", f"{ns.rel}/ana_grpid", str(spec.group),
                         partial(ns.set, "ana_grpid", str(spec.group)), _noop)
            if spec.buffered_io:
                plan.add("update", "namespace", f"{ns.rel}/buffered_io", "1",
                         partial(ns.set, "buffered_io", "1"), _noop)
            plan.add("update", "namespace", f"{ns.rel}/enable", "1",
                     partial(ns.set, "enable", "1"), partial(ns.set, "enable", "0"))
            return
        snap = self._snap_ns(sub.nqn, spec.nsid)
        changes = {a: v for a, v in want.items() if snap.get(a, "").strip().lower() != v.lower()}
        if "buffered_io" in snap and (snap["buffered_io"].strip() == "1") != spec.buffered_io:
            changes["buffered_io"] = "1" if spec.buffered_io else "0"
        enabled = snap["enable"] == "1"
        if changes and enabled:
            plan.add("update", "namespace", f"{ns.rel}/enable", "0 (to change the backing)",
                     partial(ns.set, "enable", "0"), partial(ns.set, "enable", "1"))
        for attr, value in changes.items():
            old = snap.get(attr, "")
            plan.add("update", "namespace", f"{ns.rel}/{attr}", f"{old!r} -> {value!r}",
                     partial(ns.set, attr, value),
                     partial(ns.set, attr, old) if old else _noop)
        if changes or not enabled:
            plan.add("update", "namespace", f"{ns.rel}/enable", "1",
                     partial(ns.set, "enable", "1"), partial(ns.set, "enable", "0"))
        old_grp = (ns.get("ana_grpid") or "1").strip()
        if spec.ana_group is not None and old_grp != str(spec.group):  # no disable needed
            plan.add("update", "namespace", f"{ns.rel}/ana_grpid", f"{old_grp} -> {spec.group}",
                     partial(ns.set, "ana_grpid", str(spec.group)),
                     partial(ns.set, "ana_grpid", old_grp))

    def _plan_ns_delete(self, plan: Plan, nqn: str, nsid: int, why: str) -> None:
        ns = self.root.subsystem(nqn).namespace(nsid)
        snap = self._snap_ns(nqn, nsid)
        if snap["enable"] == "1":
            plan.add("update", "namespace", f"{ns.rel}/enable", "0",
                     partial(ns.set, "enable", "0"), partial(ns.set, "enable", "1"))
        plan.add("delete", "namespace", ns.rel, why, ns.delete,
                 partial(self._restore_ns, nqn, nsid, {**snap, "enable": "0"}))

    def _port_attrs(self, lst: Listener, cfg: TargetConfig) -> dict[str, str]:
        want = {"addr_trtype": lst.transport, "addr_adrfam": lst.family,
                "addr_traddr": lst.address, "addr_trsvcid": str(lst.port)}
        inline = lst.inline_data_size
        t = cfg.transport(lst.transport)
        if inline is None and t is not None:
            inline = t.in_capsule_data_size
        if inline is not None:
            want["param_inline_data_size"] = str(inline)
        return want

    def _plan_port(self, plan: Plan, lst: Listener, cfg: TargetConfig, live: bool) -> None:
        port = self.root.port(lst.id)
        want = self._port_attrs(lst, cfg)
        if not (live and port.exists):
            plan.add("create", "port", port.rel, f"{lst.transport} {lst.address}:{lst.port}",
                     port.create, port.delete)
            for attr, value in want.items():  # addr_trtype first: it resets tsas and defaults
                plan.add("update", "port", f"{port.rel}/{attr}", value,
                         partial(port.set, attr, value), _noop)
            self._plan_port_ana(plan, port, lst, cfg, [1])  # states set before the links
            for nqn in lst.subsystems:
                plan.add("link", "port", f"{port.rel}/subsystems/{nqn}",
                         "enables the listener" if nqn == lst.subsystems[0] else "",
                         partial(port.link, nqn), partial(port.unlink, nqn))
            return
        snap = self._snap_port(port)
        have = {f"addr_{k}": v for k, v in snap["addr"].items()}
        have.update({f"param_{k}": v for k, v in snap["param"].items()})
        changes = {a: v for a, v in want.items() if have.get(a, "").strip() != v}
        links = list(snap["links"])
        if changes and links:
            # EACCES while enabled: take every subsystem off, change, put the wanted ones back.
            for nqn in links:
                plan.add("unlink", "port", f"{port.rel}/subsystems/{nqn}",
                         "to change the port's address", partial(port.unlink, nqn),
                         partial(port.link, nqn))
            links_after: list[str] = [n for n in links if n not in cfg_nqns(cfg)]
        else:
            links_after = links
        for attr, value in sorted(changes.items(), key=lambda kv: _addr_rank(kv[0])):
            old = have.get(attr, "")
            plan.add("update", "port", f"{port.rel}/{attr}", f"{old!r} -> {value!r}",
                     partial(port.set, attr, value),
                     partial(port.set, attr, old))
        if changes and links:
            for nqn in links_after:  # foreign subsystems go back on the port
                plan.add("link", "port", f"{port.rel}/subsystems/{nqn}", "relink",
                         partial(port.link, nqn), partial(port.unlink, nqn))
        for nqn in links_after:
            if nqn in cfg_nqns(cfg) and nqn not in lst.subsystems:
                plan.add("unlink", "port", f"{port.rel}/subsystems/{nqn}", "not in config",
                         partial(port.unlink, nqn), partial(port.link, nqn))
        for nqn in lst.subsystems:
            if nqn not in links_after:
                plan.add("link", "port", f"{port.rel}/subsystems/{nqn}", "",
                         partial(port.link, nqn), partial(port.unlink, nqn))
        self._plan_port_ana(plan, port, lst, cfg, port.ana_groups())

    def _plan_port_ana(self, plan: Plan, port: Port, lst: Listener, cfg: TargetConfig,
                       have: list[int]) -> None:
        """The port's ANA group directories and states for the groups of the namespaces it
        serves (only when the config uses ANA: other ports keep the kernel's defaults)."""
        if not cfg.has_ana():
            return
        groups = sorted({ns.group for nqn in lst.subsystems if cfg.subsystem(nqn) is not None
                         for ns in cfg.subsystem(nqn).namespaces})  # type: ignore[union-attr]
        for g in groups:
            want = lst.ana_state(g)
            if g not in have:
                plan.add("create", "ana_group", f"{port.rel}/ana_groups/{g}", want,
                         partial(port.make_ana_group, g), partial(port.remove_ana_group, g))
                plan.add("update", "ana_group", f"{port.rel}/ana_groups/{g}/ana_state", want,
                         partial(port.set_ana_state, g, want), _noop)
                continue
            old = (port.ana_state(g) if port.exists else None) or "optimized"
            if old != want:
                plan.add("update", "ana_group", f"{port.rel}/ana_groups/{g}/ana_state",
                         f"{old} -> {want}", partial(port.set_ana_state, g, want),
                         partial(port.set_ana_state, g, old))

    def set_ana(self, cfg: TargetConfig, lst: Listener, group: int, state: str) -> None:
        """Change ``lst``'s ANA state of ``group`` at once (``ana_groups/G/ana_state``; the
        group is made on the port when missing)."""
        port = self.root.port(lst.id)
        if not port.exists:
            raise TargetError(f"{port.rel} does not exist: is the target up?")
        if group not in port.ana_groups():
            port.make_ana_group(group)
        port.set_ana_state(group, state)

    # ---------------------------------------------------------------- down
    def plan_down(self, cfg: TargetConfig, *, keep_hosts: set[str] | None = None) -> Plan:
        """Steps that remove what ``cfg`` owns, in teardown order (docs/target.md, "Order")."""
        plan = Plan(self.name, "down")
        if not self.root.exists:
            plan.notes.append(f"{self.cfs.root} does not exist: nothing to remove")
            return plan
        owned_subs = [s.nqn for s in cfg.subsystems if self.root.subsystem(s.nqn).exists]
        owned_ports = {lst.id for lst in cfg.listeners}
        # 1. port links: every link of an owned port, and every link to an owned subsystem.
        for port in self.root.ports():
            links = port.subsystems()
            drop = [n for n in links if port.portid in owned_ports or n in owned_subs]
            if port.portid not in owned_ports and drop:
                plan.notes.append(f"ports/{port.portid} is not in the config but links "
                                  f"{', '.join(drop)}; those links are removed")
            for nqn in drop:
                plan.add("unlink", "port", f"{port.rel}/subsystems/{nqn}",
                         "disables the listener" if len(drop) == len(links) and nqn == drop[-1] else "",
                         partial(port.unlink, nqn), partial(port.link, nqn))
            # 2. the owned port itself, once nothing else is linked to it.
            if port.portid in owned_ports:
                foreign = [n for n in links if n not in drop]
                if foreign:
                    plan.notes.append(f"ports/{port.portid} is kept: it still serves {', '.join(foreign)}")
                    continue
                snap = self._snap_port(port)
                for g in port.ana_groups():
                    if g != 1:  # made by up (group 1 is the port's own)
                        state = port.ana_state(g) or "inaccessible"
                        plan.add("delete", "ana_group", f"{port.rel}/ana_groups/{g}", state,
                                 partial(port.remove_ana_group, g),
                                 partial(_remake_ana_group, port, g, state))
                plan.add("delete", "port", port.rel, _port_label(snap), port.delete,
                         partial(self._restore_port, port.portid, snap, links=False))
        # 3-4. namespaces, allowed hosts, subsystems.
        for nqn in owned_subs:
            s = self.root.subsystem(nqn)
            for ns in s.namespaces():
                self._plan_ns_delete(plan, nqn, ns.nsid, "")
            for h in s.allowed_hosts():
                plan.add("unlink", "allowed_host", f"{s.rel}/allowed_hosts/{h}", "",
                         partial(s.disallow_host, h), partial(s.allow_host, h))
            snap = self._snap_subsys(nqn)
            plan.add("delete", "subsystem", s.rel, "", s.delete,
                     partial(self._restore_subsys, nqn, snap))
        # 5. hosts nobody else allows.
        still_used = self.root.hosts_in_use(excluding=set(owned_subs)) | (keep_hosts or set())
        for nqn in cfg.all_host_nqns():
            host = self.root.host(nqn)
            if not host.exists:
                continue
            if nqn in still_used:
                plan.notes.append(f"hosts/{nqn} is kept: another subsystem allows it")
                continue
            keys = {a: host.get(a) for a in ("dhchap_key", "dhchap_ctrl_key") if host.has(a)}
            plan.add("delete", "host", host.rel, "", host.delete,
                     partial(_recreate_host, host, keys))
        return plan

    # ---------------------------------------------------------------- status
    def status(self, cfg: TargetConfig) -> dict[str, Any]:
        """What of ``cfg`` is live: subsystems, namespaces (size, LBA), listeners."""
        subsystems = []
        up = self.root.exists
        for sub in cfg.subsystems:
            s = self.root.subsystem(sub.nqn)
            if not (up and s.exists):
                subsystems.append({"nqn": sub.nqn, "state": "absent", "namespaces": [],
                                   "listeners": [], "hosts": [], "allow_any_host": False})
                continue
            namespaces = []
            for ns in s.namespaces():
                path = ns.device_path
                size = lba = None
                try:
                    if path:
                        size, lba = backing_geometry(path)
                except OSError:
                    pass
                namespaces.append({"nsid": ns.nsid, "enabled": ns.enabled, "backing": path,
                                   "size": size, "block_size": lba})
            listeners = []
            groups = sorted({(ns.get("ana_grpid") or "1").strip() for ns in s.namespaces()})
            for port in self.root.ports_linking(sub.nqn):
                a = port.address()
                ana = {g: port.ana_state(int(g)) or "inaccessible" for g in groups
                       if g.isdigit()}  # a group the port lacks: inaccessible there
                listeners.append({"id": port.portid, "transport": a.get("trtype", ""),
                                  "address": a.get("traddr", ""), "port": _int(a.get("trsvcid")),
                                  "family": a.get("adrfam", ""),
                                  **({"ana": ana} if cfg.has_ana() else {})})
            subsystems.append({"nqn": sub.nqn, "state": "up" if listeners else "no listener",
                               "allow_any_host": s.allow_any_host, "hosts": s.allowed_hosts(),
                               "namespaces": namespaces, "listeners": listeners})
        return {"backend": self.name, "configfs_root": str(self.cfs.root), "subsystems": subsystems}


def _remake_ana_group(port: Port, grpid: int, state: str) -> None:
    port.make_ana_group(grpid)
    port.set_ana_state(grpid, state)


def cfg_nqns(cfg: TargetConfig) -> set[str]:
    return {s.nqn for s in cfg.subsystems}


def _addr_rank(attr: str) -> int:
    key = attr.removeprefix("addr_")
    return PORT_ADDR_ORDER.index(key) if key in PORT_ADDR_ORDER else len(PORT_ADDR_ORDER)


def _port_label(snap: dict[str, Any]) -> str:
    a = snap["addr"]
    return f"{a.get('trtype', '?')} {a.get('traddr', '?')}:{a.get('trsvcid', '?')}"


def _recreate_host(h: Any, keys: dict[str, str | None]) -> None:
    h.create()
    for a, v in keys.items():
        if v:
            h.set(a, v)


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def create_file(path: str, size: int) -> None:
    """A sparse file of ``size`` bytes; its directory is made when missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


UndoFn = Callable[[], None]


def read_secret(path: str) -> str:
    """The ``DHHC-1`` text of a key file (checked: mode 0600, format, CRC) for configfs."""
    from kvtool.nvme.dhchap import load_secret_file
    return load_secret_file(path, field="dhchap_key_file").encode()


def _set_auth(host: Any, attr: str, value: str) -> None:
    """Write a host's DH-HMAC-CHAP attribute; a kernel built without it has no such file."""
    if not host.has(attr):
        raise TargetError(f"this kernel's nvmet has no DH-HMAC-CHAP ({host.rel}/{attr} is "
                          "missing: CONFIG_NVME_TARGET_AUTH is off, as in Debian bookworm's "
                          "6.1); use a kernel built with it (bookworm-backports 6.12), the "
                          "emulator's qemu runtime or its userspace runtime")
    host.set(attr, value)
