"""nvmetcli's JSON (``/etc/nvmet/config.json``) to and from kvtool's target model.

nvmetcli saves the configfs tree as ``{"hosts", "ports", "subsystems"}`` with attribute
groups (``attr``, ``device``, ``addr``, ``param``, ``dhchap``) holding strings
(nvmetcli's nvmet/nvme.py save/restore format). kvtool reads such a file as a config (``kvtool target up
config.json --backend nvmet`` reconciles instead of clear+restore), writes the
desired state in that format, and dumps a live tree the way ``nvmetcli save`` does.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from kvtool.target.config import TargetConfig
from kvtool.target.nvmet.configfs import Root


def looks_like_nvmetcli(data: Any) -> bool:
    """True for nvmetcli's save format (ports/subsystems with attribute groups)."""
    if not isinstance(data, dict) or "subsystem" in data or "listener" in data:
        return False
    subs = data.get("subsystems")
    return isinstance(subs, list) and ("ports" in data or any(
        isinstance(s, dict) and ("attr" in s or "allowed_hosts" in s) for s in subs))


def _is_block(path: str) -> bool:
    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False


def to_config_dict(data: dict[str, Any]) -> dict[str, Any]:
    """nvmetcli JSON → kvtool's config structure (then validated like a TOML file)."""
    out: dict[str, Any] = {"backend": "nvmet"}
    hosts = []
    for h in data.get("hosts", []):
        entry = {"nqn": h.get("nqn")}
        dh = h.get("dhchap") or {}
        if dh.get("key"):
            entry["dhchap_key"] = dh["key"]
        if dh.get("ctrl_key"):
            entry["dhchap_ctrl_key"] = dh["ctrl_key"]
        hosts.append(entry)
    if hosts:
        out["host"] = hosts
    subsystems = []
    for s in data.get("subsystems", []):
        attr = s.get("attr") or {}
        sub: dict[str, Any] = {"nqn": s.get("nqn")}
        if str(attr.get("allow_any_host", "0")).strip() in ("1", "Y", "y"):
            sub["allow_any_host"] = True
        if s.get("allowed_hosts"):
            sub["hosts"] = list(s["allowed_hosts"])
        if attr.get("serial"):
            sub["serial"] = attr["serial"]
        if attr.get("model"):
            sub["model"] = attr["model"]
        namespaces = []
        for n in s.get("namespaces", []):
            dev = n.get("device") or {}
            path = dev.get("path", "")
            ns: dict[str, Any] = {"nsid": n.get("nsid"), "path": path,
                                  "backing": "block" if _is_block(path) else "file"}
            if dev.get("uuid"):
                ns["uuid"] = dev["uuid"]
            if dev.get("nguid") and dev["nguid"].strip("0-:"):
                ns["nguid"] = dev["nguid"]
            if str(n.get("buffered_io", "0")) == "1":
                ns["buffered_io"] = True
            namespaces.append(ns)
        if namespaces:
            sub["namespace"] = namespaces
        subsystems.append(sub)
    out["subsystem"] = subsystems
    listeners = []
    for p in data.get("ports", []):
        addr = p.get("addr") or {}
        lst: dict[str, Any] = {"id": p.get("portid"), "transport": addr.get("trtype", "tcp"),
                               "address": addr.get("traddr", "127.0.0.1"),
                               "subsystems": list(p.get("subsystems", []))}
        if addr.get("trsvcid"):
            try:
                lst["port"] = int(addr["trsvcid"])
            except ValueError:
                lst["port"] = addr["trsvcid"]
        inline = (p.get("param") or {}).get("inline_data_size")
        if inline not in (None, "", "-1"):
            lst["inline_data_size"] = int(inline)
        if lst["subsystems"]:  # nvmetcli allows unlinked ports; kvtool's listeners serve something
            listeners.append(lst)
    if listeners:
        out["listener"] = listeners
    return out


def from_config(cfg: TargetConfig) -> dict[str, Any]:
    """The desired state of ``cfg`` in nvmetcli's format (what ``nvmetcli restore`` reads)."""
    hosts = []
    for nqn in cfg.all_host_nqns():
        entry: dict[str, Any] = {"nqn": nqn}
        h = cfg.host(nqn)
        if h is not None and h.dhchap_key_file:
            # the secrets stay in their key files: nvmetcli restore leaves the keys unset
            entry["dhchap"] = {"hash": f"hmac({(h.dhchap_hashes or ('sha256',))[0]})",
                               "dhgroup": (h.dhchap_dhgroups or ("null",))[0]}
        hosts.append(entry)
    subsystems = []
    for s in cfg.subsystems:
        attr = {"allow_any_host": "1" if s.allow_any_host else "0"}
        if s.serial:
            attr["serial"] = s.serial
        if s.model:
            attr["model"] = s.model
        namespaces = []
        for n in s.namespaces:
            device: dict[str, str] = {"path": n.path or ""}
            if n.uuid:
                device["uuid"] = n.uuid
            if n.nguid:
                device["nguid"] = n.nguid
            namespaces.append({"nsid": n.nsid, "enable": 1, "device": device})
        subsystems.append({"nqn": s.nqn, "attr": attr, "allowed_hosts": list(s.hosts),
                           "namespaces": namespaces})
    ports = []
    for lst in cfg.listeners:
        addr = {"trtype": lst.transport, "adrfam": lst.family, "traddr": lst.address,
                "trsvcid": str(lst.port), "treq": "not specified"}
        port: dict[str, Any] = {"portid": lst.id, "addr": addr, "subsystems": list(lst.subsystems),
                                "referrals": []}
        if lst.inline_data_size:
            port["param"] = {"inline_data_size": str(lst.inline_data_size)}
        ports.append(port)
    return {"hosts": hosts, "ports": ports, "subsystems": subsystems}


def dump_tree(root: Root) -> dict[str, Any]:
    """The live configfs tree in nvmetcli's save format (like ``nvmetcli save``)."""
    hosts = []
    for h in root.hosts():
        entry: dict[str, Any] = {"nqn": h.nqn}
        dh = {k: v for k, v in h.attrs("dhchap").items()
              if k not in ("key", "ctrl_key")}  # secrets are not exported
        if dh:
            entry["dhchap"] = dh
        hosts.append(entry)
    subsystems = []
    for s in root.subsystems():
        namespaces = []
        for ns in s.namespaces():
            entry = {"nsid": ns.nsid, "enable": 1 if ns.enabled else 0, "device": ns.attrs("device")}
            if ns.has("buffered_io"):  # kvtool extension: nvmetcli does not save it
                entry["buffered_io"] = int((ns.get("buffered_io") or "0").strip() == "1")
            grp = ns.get("ana_grpid")
            if grp:
                entry["ana_grpid"] = int(grp)
            namespaces.append(entry)
        subsystems.append({"nqn": s.nqn, "attr": s.attrs("attr"),
                           "allowed_hosts": s.allowed_hosts(), "namespaces": namespaces})
    ports = []
    for p in root.ports():
        ports.append({"portid": p.portid, "addr": p.attrs("addr"), "param": p.attrs("param"),
                      "subsystems": p.subsystems(), "referrals": p.referrals()})
    return {"hosts": hosts, "ports": ports, "subsystems": subsystems}
