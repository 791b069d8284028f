"""The SPDK backend: plan JSON-RPC calls that turn a running ``spdk_tgt`` into the config.

State is read with ``spdk_get_version``, ``nvmf_get_transports``, ``nvmf_get_subsystems``,
``bdev_get_bdevs`` and ``bdev_nvme_get_controllers``. The config owns its subsystems (by
NQN) and the bdevs it names (``bdev_name``, or ``kvt<hash>n<nsid>`` derived from the
subsystem NQN and NSID, so re-runs find them). Transports are shared by every subsystem of
the application and SPDK cannot delete one, so ``up`` creates a missing transport (the one
step it cannot undo; see :attr:`Plan.notes`) and ``down`` leaves transports alone.

Order (create): transport → bdevs → subsystem → namespaces → hosts → listeners (hosts can
connect only once everything behind the listener exists). Teardown is the reverse, and every
step carries the call that undoes it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from functools import partial
from typing import Any

from kvtool.errors import InputError
from kvtool.nvme.spec import DISCOVERY_NQN
from kvtool.target.config import Namespace, Subsystem, TargetConfig
from kvtool.target.nvmet.backend import create_file
from kvtool.target.plan import Plan, TargetError
from kvtool.target.spdk.rpc import DEFAULT_SOCKET, SpdkRpc

# nvmf_create_transport's io_unit_size was removed in SPDK 26.01 (schema/schema.yaml has no
# such parameter; the buffer size is set at start-up with iobuf_set_options).
IO_UNIT_SIZE_LAST_MAJOR = 25


def bdev_name_for(nqn: str, ns: Namespace) -> str:
    """The bdev a namespace uses: its ``bdev_name``, else a stable name from NQN and NSID."""
    if ns.bdev_name:
        return ns.bdev_name
    h = hashlib.sha1(nqn.encode()).hexdigest()[:8]
    if ns.backing == "nvme":
        assert ns.nvme is not None
        return f"kvt{h}c{ns.nsid}n{ns.nvme.namespace}"
    return f"kvt{h}n{ns.nsid}"


def nvme_controller_name(bdev: str) -> str:
    """``bdev_nvme_attach_controller`` names bdevs ``<controller>n<k>``."""
    return bdev.rsplit("n", 1)[0]


def bdev_create_call(nqn: str, ns: Namespace) -> tuple[str, dict[str, Any]]:
    """The RPC (method, params) that creates the bdev behind ``ns``."""
    name = bdev_name_for(nqn, ns)
    if ns.backing == "memory":
        assert ns.size is not None
        params: dict[str, Any] = {"name": name, "block_size": ns.block_size,
                                  "num_blocks": ns.size // ns.block_size}
        if ns.uuid:
            params["uuid"] = ns.uuid
        return "bdev_malloc_create", params
    if ns.backing in ("file", "block"):
        params = {"name": name, "filename": ns.path}
        if ns.lba:
            params["block_size"] = ns.lba
        if ns.uuid:
            params["uuid"] = ns.uuid
        return f"bdev_{ns.bdev_module}_create", params
    assert ns.nvme is not None
    a = ns.nvme
    params = {"name": nvme_controller_name(name), "trtype": a.trtype, "traddr": a.traddr}
    for key in ("adrfam", "trsvcid", "subnqn"):
        if getattr(a, key):
            params[key] = getattr(a, key)
    return "bdev_nvme_attach_controller", params


def bdev_delete_call(ns_backing: str, bdev: str, module: str = "aio") -> tuple[str, dict[str, Any]]:
    if ns_backing == "memory":
        return "bdev_malloc_delete", {"name": bdev}
    if ns_backing in ("file", "block"):
        return f"bdev_{module}_delete", {"name": bdev}
    return "bdev_nvme_detach_controller", {"name": nvme_controller_name(bdev)}


SPDK_ANA = {"optimized": "optimized", "non-optimized": "non_optimized",
            "inaccessible": "inaccessible"}  # kvtool's name -> SPDK's
KVTOOL_ANA = {v: k for k, v in SPDK_ANA.items()}


def create_subsystem_params(sub: Subsystem, ana: bool = False) -> dict[str, Any]:
    """``nvmf_create_subsystem`` parameters; optional fields only when the config sets them
    (``ana``: the config uses ANA groups or listener states: ``ana_reporting``)."""
    params: dict[str, Any] = {"nqn": sub.nqn, "allow_any_host": sub.allow_any_host}
    if ana:
        params["ana_reporting"] = True
    if sub.serial:
        params["serial_number"] = sub.serial
    if sub.model:
        params["model_number"] = sub.model
    if sub.max_namespaces:
        params["max_namespaces"] = sub.max_namespaces
    return params


def namespace_body(nqn: str, ns: Namespace, ana: bool = False) -> dict[str, Any]:
    """``nvmf_subsystem_add_ns``'s namespace object (``anagrpid`` with ANA reporting)."""
    body: dict[str, Any] = {"nsid": ns.nsid, "bdev_name": bdev_name_for(nqn, ns)}
    if ns.uuid:
        body["uuid"] = ns.uuid
    if ns.nguid:
        body["nguid"] = ns.nguid
    if ana:
        body["anagrpid"] = ns.group
    return body


def listen_address(lst: Any) -> dict[str, str]:
    return {"trtype": lst.transport.upper(), "adrfam": "IPv4" if lst.family == "ipv4" else "IPv6",
            "traddr": lst.address, "trsvcid": str(lst.port)}


def transport_params(cfg: TargetConfig, trtype: str, major: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {"trtype": trtype.upper()}
    t = cfg.transport(trtype)
    if t is None:
        return params
    for key in ("in_capsule_data_size", "max_io_size", "max_queue_depth", "max_io_qpairs_per_ctrlr"):
        v = getattr(t, key)
        if v is not None:
            params[key] = v
    if t.io_unit_size is not None:
        if major is not None and major > IO_UNIT_SIZE_LAST_MAJOR:
            i = cfg.transports.index(t)
            file, line = cfg.where("transport", i, "io_unit_size")
            raise InputError(f"SPDK v{major} removed io_unit_size from nvmf_create_transport; "
                             "set the buffer size when starting spdk_tgt (iobuf_set_options "
                             "large_bufsize) and drop this key", file=file, line=line,
                             field=f"transport[{i}].io_unit_size")
        params["io_unit_size"] = t.io_unit_size
    return params


def _same_addr(a: dict[str, Any], b: dict[str, str]) -> bool:
    return (str(a.get("trtype", "")).upper() == b["trtype"] and a.get("traddr") == b["traddr"]
            and str(a.get("trsvcid", "")) == b["trsvcid"])


class SpdkBackend:
    """Plans and reads SPDK NVMe-oF state over JSON-RPC."""

    name = "spdk"

    def __init__(self, rpc: SpdkRpc | None = None, *, socket_path: str | None = None,
                 timeout: float = 60.0) -> None:
        self.rpc = rpc or SpdkRpc(socket_path or DEFAULT_SOCKET, timeout)

    # ------------------------------------------------------------ reading
    def version(self) -> tuple[str, int | None]:
        v = self.rpc.call("spdk_get_version")
        fields = v.get("fields") or {}
        major = fields.get("major")
        return str(v.get("version", "")), int(major) if isinstance(major, int) else None

    def read(self) -> dict[str, Any]:
        return {
            "transports": self.rpc.call("nvmf_get_transports"),
            "subsystems": {s["nqn"]: s for s in self.rpc.call("nvmf_get_subsystems")},
            "bdevs": {b["name"]: b for b in self.rpc.call("bdev_get_bdevs")},
            "controllers": {c["name"]: c for c in self.rpc.call("bdev_nvme_get_controllers")},
        }

    def _keyring(self) -> dict[str, dict[str, Any]]:
        """The keyring's keys by name (name, path; never the key itself)."""
        return {k["name"]: k for k in self.rpc.call("keyring_get_keys")}

    def _call(self, method: str, params: dict[str, Any]) -> Callable[[], Any]:
        return partial(self.rpc.call, method, params)

    # ------------------------------------------------------------ up
    def plan_up(self, cfg: TargetConfig, previous: TargetConfig | None = None) -> Plan:
        plan = Plan(self.name, "up")
        version, major = self.version()
        plan.notes.append(f"target: {version}")
        live = self.read()
        if previous is not None:
            gone = [s for s in previous.subsystems if cfg.subsystem(s.nqn) is None]
            if gone:
                stale = TargetConfig(name=previous.name, backend="spdk", subsystems=tuple(gone),
                                     listeners=())
                plan.steps.extend(self._down_steps(stale, live))

        have_tr = {str(t.get("trtype", "")).upper(): t for t in live["transports"]}
        for trtype in sorted({lst.transport for lst in cfg.listeners} | {t.type for t in cfg.transports}):
            want = transport_params(cfg, trtype, major)
            have = have_tr.get(trtype.upper())
            if have is None:
                plan.add("create", "transport", trtype.upper(),
                         ", ".join(f"{k}={v}" for k, v in want.items() if k != "trtype"),
                         self._call("nvmf_create_transport", want))  # SPDK cannot delete one
                plan.notes.append(f"transport {trtype.upper()} is created once and kept: "
                                  "SPDK has no RPC to delete a transport")
            else:
                diff = {k: v for k, v in want.items() if k != "trtype" and k in have and have[k] != v}
                if diff:
                    plan.notes.append(f"transport {trtype.upper()} already exists with "
                                      f"{', '.join(f'{k}={have[k]}' for k in diff)}; SPDK cannot "
                                      "change a live transport (restart spdk_tgt to apply "
                                      f"{', '.join(f'{k}={v}' for k, v in diff.items())})")

        self._plan_keys(plan, cfg)
        for sub in cfg.subsystems:
            self._plan_subsystem(plan, sub, cfg, live)
        return plan

    def _plan_keys(self, plan: Plan, cfg: TargetConfig) -> None:
        """keyring_file_add_key for every key file (SPDK reads the file; mode 0600)."""
        if any(h.dhchap_hashes or h.dhchap_dhgroups for h in cfg.host_keys()):
            plan.notes.append("SPDK allows DH-HMAC-CHAP hashes and DH groups for the whole "
                              "target, at start-up only (nvmf_set_config --dhchap-digests/"
                              "--dhchap-dhgroups with spdk_tgt --wait-for-rpc); the per-host "
                              "lists are not applied to a running target, which offers all and "
                              "picks the strongest the host offers")
        have = self._keyring() if key_names(cfg) else {}
        self._replaced_keys: set[str] = set()
        for name, path in key_names(cfg):
            old = have.get(name)
            if old is not None and old.get("path") == path:
                continue
            if old is not None:
                self._replaced_keys.add(name)  # hosts using it get it again (set_keys)
                plan.add("delete", "key", name, f"keyring entry for {old.get('path')}",
                         self._call("keyring_file_remove_key", {"name": name}),
                         self._call("keyring_file_add_key", {"name": name,
                                                             "path": old.get("path")}))
            plan.add("create", "key", name, f"keyring_file_add_key {path}",
                     self._call("keyring_file_add_key", {"name": name, "path": path}),
                     self._call("keyring_file_remove_key", {"name": name}))

    def _bdev_stale(self, sub: Subsystem, ns: Namespace, live: dict[str, Any]) -> bool:
        """True when the namespace's bdev is missing or differs from the config."""
        have = live["bdevs"].get(bdev_name_for(sub.nqn, ns))
        return have is None or not self._bdev_matches(ns, have)

    def _plan_bdev(self, plan: Plan, sub: Subsystem, ns: Namespace, live: dict[str, Any]) -> None:
        """Create the namespace's bdev (replacing a different one of the same name)."""
        name = bdev_name_for(sub.nqn, ns)
        method, params = bdev_create_call(sub.nqn, ns)
        have = live["bdevs"].get(name)
        if ns.create and ns.path and not os.path.exists(ns.path):
            # spdk_tgt is local (Unix-socket RPC), so the file it opens is this machine's.
            plan.add("create", "file", ns.path, f"{ns.size} bytes, sparse",
                     partial(create_file, ns.path, ns.size or 0), partial(os.unlink, ns.path))
        delete = bdev_delete_call(ns.backing, name, ns.bdev_module)
        if have is not None:
            old = _recreate_call(have)
            plan.add("delete", "bdev", name, "differs from the config",
                     self._call(*delete_for_live(have)), self._call(*old) if old else None)
        plan.add("create", "bdev", name, _bdev_label(method, params), self._call(method, params),
                 self._call(*delete))

    @staticmethod
    def _bdev_matches(ns: Namespace, have: dict[str, Any]) -> bool:
        if ns.backing == "memory":
            return (have.get("block_size") == ns.block_size and ns.size is not None
                    and have.get("num_blocks") == ns.size // ns.block_size)
        if ns.backing in ("file", "block"):
            spec = (have.get("driver_specific") or {}).get(ns.bdev_module) or {}
            return (spec.get("filename") in (None, ns.path)
                    and (ns.lba is None or have.get("block_size") == ns.lba))
        return True

    def _plan_subsystem(self, plan: Plan, sub: Subsystem, cfg: TargetConfig,
                        live: dict[str, Any]) -> None:
        have = live["subsystems"].get(sub.nqn)
        stale = [ns for ns in sub.namespaces if self._bdev_stale(sub, ns, live)]
        recreated = {ns.nsid for ns in stale}
        nqn = sub.nqn
        # Namespaces come off before their bdev is replaced (deleting a bdev in use would
        # hot-remove the namespace behind the plan's back).
        have_ns = {n["nsid"]: n for n in (have or {}).get("namespaces", [])}
        for nsid, n in have_ns.items():
            spec = sub.namespace(nsid)
            if spec is None or nsid in recreated or n.get("bdev_name") != bdev_name_for(nqn, spec):
                plan.add("delete", "namespace", f"{nqn} nsid {nsid}", n.get("bdev_name", ""),
                         self._call("nvmf_subsystem_remove_ns", {"nqn": nqn, "nsid": nsid}),
                         self._call("nvmf_subsystem_add_ns", {"nqn": nqn, "namespace": {
                             "nsid": nsid, "bdev_name": n.get("bdev_name")}}))
        for ns in stale:
            self._plan_bdev(plan, sub, ns, live)
        if have is None:
            plan.add("create", "subsystem", sub.nqn, "ANA reporting" if cfg.has_ana() else "",
                     self._call("nvmf_create_subsystem", create_subsystem_params(sub, cfg.has_ana())),
                     self._call("nvmf_delete_subsystem", {"nqn": sub.nqn}))
            have = {"namespaces": [], "hosts": [], "listen_addresses": [],
                    "allow_any_host": sub.allow_any_host}
        else:
            for key, want in (("serial_number", sub.serial), ("model_number", sub.model)):
                if want is not None and have.get(key) not in (None, want):
                    plan.notes.append(f"{sub.nqn}: {key} is {have.get(key)!r}, config says "
                                      f"{want!r}; SPDK cannot change it on a live subsystem "
                                      "(target down, then up)")
        for ns in sub.namespaces:
            n = have_ns.get(ns.nsid)
            if n is not None and ns.nsid not in recreated and n.get("bdev_name") == bdev_name_for(nqn, ns):
                continue
            body = namespace_body(nqn, ns, cfg.has_ana())
            plan.add("create", "namespace", f"{nqn} nsid {ns.nsid}", body["bdev_name"],
                     self._call("nvmf_subsystem_add_ns", {"nqn": nqn, "namespace": body}),
                     self._call("nvmf_subsystem_remove_ns", {"nqn": nqn, "nsid": ns.nsid}))

        have_hosts = [h["nqn"] if isinstance(h, dict) else h for h in have.get("hosts", [])]
        have_keys = {h["nqn"]: (h.get("dhchap_key"), h.get("dhchap_ctrlr_key"))
                     for h in have.get("hosts", []) if isinstance(h, dict)}
        for h in have_hosts:
            replaced = set(host_key_names(cfg, h)) & getattr(self, "_replaced_keys", set())
            if h in sub.hosts and (have_keys.get(h, (None, None)) != host_key_names(cfg, h)
                                   or replaced):
                params = host_params(cfg, nqn, h)
                plan.add("update", "host", f"{nqn} host {h}", "DH-HMAC-CHAP keys",
                         self._call("nvmf_subsystem_set_keys", params),
                         None)
            if h not in sub.hosts:
                plan.add("delete", "host", f"{nqn} host {h}", "not in config",
                         self._call("nvmf_subsystem_remove_host", {"nqn": nqn, "host": h}),
                         self._call("nvmf_subsystem_add_host", {"nqn": nqn, "host": h}))
        if bool(have.get("allow_any_host")) != sub.allow_any_host:
            plan.add("update", "subsystem", nqn, f"allow_any_host={sub.allow_any_host}",
                     self._call("nvmf_subsystem_allow_any_host",
                                {"nqn": nqn, "allow_any_host": sub.allow_any_host}),
                     self._call("nvmf_subsystem_allow_any_host",
                                {"nqn": nqn, "allow_any_host": not sub.allow_any_host}))
        for h in sub.hosts:
            if h not in have_hosts:
                params = host_params(cfg, nqn, h)
                plan.add("create", "host", f"{nqn} host {h}",
                         "DH-HMAC-CHAP" if "dhchap_key" in params else "",
                         self._call("nvmf_subsystem_add_host", params),
                         self._call("nvmf_subsystem_remove_host", {"nqn": nqn, "host": h}))

        self._plan_listeners(plan, nqn, cfg, have.get("listen_addresses", []))
        if cfg.has_ana():
            self._plan_ana(plan, sub, cfg, live)

    def _plan_listeners(self, plan: Plan, nqn: str, cfg: TargetConfig,
                        have_addrs: list[dict[str, Any]]) -> None:
        """The subsystem's listen addresses: those SPDK has that the config lacks come off,
        the config's missing ones are added."""
        want_addrs = [listen_address(lst) for lst in cfg.listeners_of(nqn)]
        for a in have_addrs:
            if not any(_same_addr(a, w) for w in want_addrs):
                addr = _addr(a)
                plan.add("delete", "listener", f"{nqn} {_label(addr)}", "not in config",
                         self._call("nvmf_subsystem_remove_listener", {"nqn": nqn, "listen_address": addr}),
                         self._call("nvmf_subsystem_add_listener", {"nqn": nqn, "listen_address": addr}))
        for w in want_addrs:
            if not any(_same_addr(a, w) for a in have_addrs):
                plan.add("create", "listener", f"{nqn} {_label(w)}", "",
                         self._call("nvmf_subsystem_add_listener", {"nqn": nqn, "listen_address": w}),
                         self._call("nvmf_subsystem_remove_listener", {"nqn": nqn, "listen_address": w}))

    def _plan_ana(self, plan: Plan, sub: Subsystem, cfg: TargetConfig,
                  live: dict[str, Any]) -> None:
        """Each listener's ANA state per group, where it differs from what SPDK has (a new
        listener starts optimized in every group)."""
        nqn = sub.nqn
        have = {} if sub.nqn not in live["subsystems"] else self.listener_ana(nqn)
        groups = sorted({ns.group for ns in sub.namespaces})
        for lst in cfg.listeners_of(nqn):
            addr = listen_address(lst)
            now = have.get(_label(addr), {})
            for g in groups:
                want, was = lst.ana_state(g), now.get(g, "optimized")
                if want == was:
                    continue
                plan.add("update", "listener", f"{nqn} {_label(addr)} ANA group {g}",
                         f"{was} -> {want}", self._set_ana_call(nqn, addr, g, want),
                         self._set_ana_call(nqn, addr, g, was))

    def _set_ana_call(self, nqn: str, addr: dict[str, str], group: int,
                      state: str) -> Callable[[], Any]:
        return self._call("nvmf_subsystem_listener_set_ana_state",
                          {"nqn": nqn, "listen_address": addr, "ana_state": SPDK_ANA[state],
                           "anagrpid": group})

    def listener_ana(self, nqn: str) -> dict[str, dict[int, str]]:
        """{listener label: {group: state}} as SPDK reports it (groups 1..max_nsid; none
        when the subsystem has no ANA reporting)."""
        out: dict[str, dict[int, str]] = {}
        for lst in self.rpc.call("nvmf_subsystem_get_listeners", {"nqn": nqn}):
            states = {int(s["ana_group"]): KVTOOL_ANA.get(s.get("ana_state"), s.get("ana_state"))
                      for s in lst.get("ana_states", [])}
            out[_label(_addr(lst.get("address", {})))] = states
        return out

    def set_ana(self, cfg: TargetConfig, lst: Any, group: int, state: str) -> None:
        """Change ``lst``'s ANA state of ``group`` at once, on every subsystem it serves
        (``nvmf_subsystem_listener_set_ana_state``)."""
        addr = listen_address(lst)
        for sub in cfg.subsystems:
            if lst not in cfg.listeners_of(sub.nqn):
                continue
            if not self.listener_ana(sub.nqn).get(_label(addr)):
                raise TargetError(f"{sub.nqn} has no ANA reporting (SPDK sets it when the "
                                  "subsystem is created): give a namespace an ana_group or a "
                                  "listener an ana table in the config, then target down and up")
            self._set_ana_call(sub.nqn, addr, group, state)()

    # ------------------------------------------------------------ down
    def plan_down(self, cfg: TargetConfig) -> Plan:
        plan = Plan(self.name, "down")
        plan.steps.extend(self._down_steps(cfg, self.read()))
        plan.notes.append("transports are kept (shared by the whole application)")
        return plan

    def _down_steps(self, cfg: TargetConfig, live: dict[str, Any]) -> list[Any]:
        plan = Plan(self.name, "down")
        for sub in cfg.subsystems:
            have = live["subsystems"].get(sub.nqn)
            nqn = sub.nqn
            if have is not None:
                for a in have.get("listen_addresses", []):
                    addr = _addr(a)
                    la = {"nqn": nqn, "listen_address": addr}
                    plan.add("delete", "listener", f"{nqn} {_label(addr)}", "",
                             self._call("nvmf_subsystem_remove_listener", la),
                             self._call("nvmf_subsystem_add_listener", la))
                for n in have.get("namespaces", []):
                    plan.add("delete", "namespace", f"{nqn} nsid {n['nsid']}", n.get("bdev_name", ""),
                             self._call("nvmf_subsystem_remove_ns", {"nqn": nqn, "nsid": n["nsid"]}),
                             self._call("nvmf_subsystem_add_ns", {"nqn": nqn, "namespace": {
                                 "nsid": n["nsid"], "bdev_name": n.get("bdev_name")}}))
                for h in have.get("hosts", []):
                    host = h["nqn"] if isinstance(h, dict) else h
                    readd = {"nqn": nqn, "host": host, **{
                        k: h[k] for k in ("dhchap_key", "dhchap_ctrlr_key")
                        if isinstance(h, dict) and h.get(k)}}
                    plan.add("delete", "host", f"{nqn} host {host}", "",
                             self._call("nvmf_subsystem_remove_host", {"nqn": nqn, "host": host}),
                             self._call("nvmf_subsystem_add_host", readd))
                recreate: dict[str, Any] = {"nqn": nqn,
                                            "allow_any_host": bool(have.get("allow_any_host"))}
                for key in ("serial_number", "model_number", "max_namespaces"):
                    if have.get(key):
                        recreate[key] = have[key]
                plan.add("delete", "subsystem", nqn, "",
                         self._call("nvmf_delete_subsystem", {"nqn": nqn}),
                         self._call("nvmf_create_subsystem", recreate))
            for ns in sub.namespaces:
                name = bdev_name_for(nqn, ns)
                b = live["bdevs"].get(name)
                if b is None:
                    continue
                old = _recreate_call(b)
                plan.add("delete", "bdev", name, "",
                         self._call(*delete_for_live(b)), self._call(*old) if old else None)
        keys = self._keyring() if key_names(cfg) else {}
        for name, _path in key_names(cfg):
            if name in keys:  # after the hosts that use it are gone
                plan.add("delete", "key", name, "keyring entry",
                         self._call("keyring_file_remove_key", {"name": name}),
                         self._call("keyring_file_add_key",
                                    {"name": name, "path": keys[name].get("path")}))
        return plan.steps

    # ------------------------------------------------------------ status / export
    def status(self, cfg: TargetConfig) -> dict[str, Any]:
        version, _ = self.version()
        live = self.read()
        subsystems = []
        for sub in cfg.subsystems:
            have = live["subsystems"].get(sub.nqn)
            if have is None:
                subsystems.append({"nqn": sub.nqn, "state": "absent", "namespaces": [],
                                   "listeners": [], "hosts": [], "allow_any_host": False})
                continue
            namespaces = []
            for n in have.get("namespaces", []):
                b = live["bdevs"].get(n.get("bdev_name"), {})
                bs, nb = b.get("block_size"), b.get("num_blocks")
                namespaces.append({"nsid": n["nsid"], "enabled": True, "backing": n.get("bdev_name"),
                                   "size": bs * nb if bs and nb else None, "block_size": bs})
            groups = sorted({n.get("anagrpid") for n in have.get("namespaces", [])
                             if n.get("anagrpid")})  # listed only with ANA reporting
            ana = self.listener_ana(sub.nqn) if groups and have.get("listen_addresses") else {}
            listeners = [{"id": None, "transport": str(a.get("trtype", "")).lower(),
                          "address": a.get("traddr"), "port": int(a.get("trsvcid") or 0),
                          "family": str(a.get("adrfam", "")).lower(),
                          **({"ana": {str(g): ana[_label(_addr(a))].get(g) for g in groups}}
                             if ana.get(_label(_addr(a))) and groups else {})}
                         for a in have.get("listen_addresses", [])]
            hosts = [h["nqn"] if isinstance(h, dict) else h for h in have.get("hosts", [])]
            subsystems.append({"nqn": sub.nqn, "state": "up" if listeners else "no listener",
                               "allow_any_host": bool(have.get("allow_any_host")), "hosts": hosts,
                               "namespaces": namespaces, "listeners": listeners})
        return {"backend": self.name, "spdk_version": version, "socket": self.rpc.socket_path,
                "subsystems": subsystems}

    def live_config(self) -> dict[str, Any]:
        """``framework_get_config`` of the bdev and nvmf subsystems, as ``save_config`` writes."""
        out = []
        for name in ("bdev", "nvmf"):
            out.append({"subsystem": name, "config": self.rpc.call("framework_get_config", {"name": name})})
        return {"subsystems": out}


def spdk_config(cfg: TargetConfig, major: int | None = None) -> dict[str, Any]:
    """The desired state as SPDK's JSON config (``spdk_tgt -c FILE`` / ``load_config``)."""
    bdev_calls: list[dict[str, Any]] = []
    nvmf_calls: list[dict[str, Any]] = []
    for trtype in sorted({lst.transport for lst in cfg.listeners} | {t.type for t in cfg.transports}):
        nvmf_calls.append({"method": "nvmf_create_transport",
                           "params": transport_params(cfg, trtype, major)})
    for sub in cfg.subsystems:
        for ns in sub.namespaces:
            method, params = bdev_create_call(sub.nqn, ns)
            bdev_calls.append({"method": method, "params": params})
        nvmf_calls.append({"method": "nvmf_create_subsystem",
                           "params": create_subsystem_params(sub, cfg.has_ana())})
        for ns in sub.namespaces:
            nvmf_calls.append({"method": "nvmf_subsystem_add_ns",
                               "params": {"nqn": sub.nqn,
                                          "namespace": namespace_body(sub.nqn, ns, cfg.has_ana())}})
        for h in sub.hosts:
            nvmf_calls.append({"method": "nvmf_subsystem_add_host",
                               "params": host_params(cfg, sub.nqn, h)})
        for lst in cfg.listeners_of(sub.nqn):
            nvmf_calls.append({"method": "nvmf_subsystem_add_listener",
                               "params": {"nqn": sub.nqn, "listen_address": listen_address(lst)}})
            for g in sorted({ns.group for ns in sub.namespaces}) if cfg.has_ana() else []:
                if lst.ana_state(g) != "optimized":
                    nvmf_calls.append({"method": "nvmf_subsystem_listener_set_ana_state",
                                       "params": {"nqn": sub.nqn,
                                                  "listen_address": listen_address(lst),
                                                  "ana_state": SPDK_ANA[lst.ana_state(g)],
                                                  "anagrpid": g}})
    out = [{"subsystem": "bdev", "config": bdev_calls},
           {"subsystem": "nvmf", "config": nvmf_calls}]
    keys = [{"method": "keyring_file_add_key", "params": {"name": name, "path": path}}
            for name, path in key_names(cfg)]
    if keys:  # key file paths only: SPDK reads the secrets
        out.insert(0, {"subsystem": "keyring", "config": keys})
    return {"subsystems": out}


def _key_name(hostnqn: str, ctrl: bool) -> str:
    digest = hashlib.sha256(hostnqn.encode()).hexdigest()[:12]
    return f"kvtool-{digest}-{'ckey' if ctrl else 'key'}"


def host_key_names(cfg: TargetConfig, hostnqn: str) -> tuple[str | None, str | None]:
    """SPDK keyring names of ``hostnqn``'s secrets (derived from the NQN; None: no key)."""
    h = cfg.host(hostnqn)
    if h is None or not h.dhchap_key_file:
        return None, None
    return (_key_name(hostnqn, False),
            _key_name(hostnqn, True) if h.dhchap_ctrl_key_file else None)


def key_names(cfg: TargetConfig) -> list[tuple[str, str]]:
    """(keyring name, key file) for every key file in ``cfg``."""
    out = []
    for h in cfg.host_keys():
        assert h.dhchap_key_file is not None
        out.append((_key_name(h.nqn, False), h.dhchap_key_file))
        if h.dhchap_ctrl_key_file:
            out.append((_key_name(h.nqn, True), h.dhchap_ctrl_key_file))
    return out


def host_params(cfg: TargetConfig, nqn: str, hostnqn: str) -> dict[str, Any]:
    """``nvmf_subsystem_add_host`` parameters, with the host's keyring names if it has keys."""
    params: dict[str, Any] = {"nqn": nqn, "host": hostnqn}
    key, ckey = host_key_names(cfg, hostnqn)
    if key:
        params["dhchap_key"] = key
    if ckey:
        params["dhchap_ctrlr_key"] = ckey
    return params


def delete_for_live(b: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The delete call for a live bdev, from its product name."""
    product = str(b.get("product_name", "")).lower()
    name = b["name"]
    if "malloc" in product:
        return "bdev_malloc_delete", {"name": name}
    if "uring" in product:
        return "bdev_uring_delete", {"name": name}
    if "nvme" in product:
        return "bdev_nvme_detach_controller", {"name": nvme_controller_name(name)}
    return "bdev_aio_delete", {"name": name}


def _recreate_call(b: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """A call that recreates a live bdev (for undo); None when it cannot be rebuilt."""
    product = str(b.get("product_name", "")).lower()
    name = b["name"]
    spec = b.get("driver_specific") or {}
    if "malloc" in product:
        return "bdev_malloc_create", {"name": name, "block_size": b["block_size"],
                                      "num_blocks": b["num_blocks"]}
    for module in ("aio", "uring"):
        if module in product and (spec.get(module) or {}).get("filename"):
            return f"bdev_{module}_create", {"name": name, "filename": spec[module]["filename"],
                                             "block_size": b["block_size"]}
    if "nvme" in product:
        nvme = spec.get("nvme")
        entry = nvme[0] if isinstance(nvme, list) and nvme else nvme
        trid = (entry or {}).get("trid") or {}
        if trid.get("trtype") and trid.get("traddr"):
            params = {"name": nvme_controller_name(name), "trtype": trid["trtype"],
                      "traddr": trid["traddr"]}
            for key in ("adrfam", "trsvcid", "subnqn"):
                if trid.get(key):
                    params[key] = trid[key]
            return "bdev_nvme_attach_controller", params
    return None


def _addr(a: dict[str, Any]) -> dict[str, str]:
    out = {"trtype": str(a.get("trtype", "")), "traddr": str(a.get("traddr", ""))}
    if a.get("adrfam"):
        out["adrfam"] = str(a["adrfam"])
    if a.get("trsvcid"):
        out["trsvcid"] = str(a["trsvcid"])
    return out


def _label(a: dict[str, str]) -> str:
    return f"{a.get('trtype', '').lower()} {a.get('traddr')}:{a.get('trsvcid')}"


def _bdev_label(method: str, params: dict[str, Any]) -> str:
    if method == "bdev_malloc_create":
        return f"malloc {params['num_blocks']} x {params['block_size']} B"
    if method == "bdev_nvme_attach_controller":
        return f"nvme {params['trtype']} {params['traddr']}"
    return f"{method.split('_')[1]} {params['filename']}"


__all__ = ["DISCOVERY_NQN", "SpdkBackend", "bdev_name_for", "spdk_config"]
