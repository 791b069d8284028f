"""Target configuration: listeners, limits, subsystems, namespaces, allowed hosts.

The JSON form (``--config FILE.json``; schema in docs/nvme-tcp.md) maps one-to-one onto
these dataclasses. Validation raises :class:`~kvtool.errors.InputError` naming the file
and the field (``subsystems[0].namespaces[1].lba_size``), so the CLI prints one line and
exits 2.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.configfile import ConfigDocument, ConfigTable, read_config
from kvtool.errors import InputError
from kvtool.nvme.dhchap import dhgroup_id, hash_id
from kvtool.nvme.spec import ANA_STATES, DISCOVERY_NQN, is_loopback, nqn_problem

DEFAULT_LISTEN = "127.0.0.1:4420"
LBA_SIZES = (512, 4096)
MAX_MDTS = 12  # 16 MiB per command: bounds what one command may make the target buffer
ANAGRPMAX = 128  # ANA groups 1..128, as Linux nvmet (NVMET_MAX_ANAGRPS)


@dataclass
class NamespaceConfig:
    nsid: int
    backing: str  # an existing path, or a size such as "64MiB" for memory
    size: str | None = None  # create the file at ``backing`` with this size when missing
    lba_size: int = 512
    anagrpid: int = 1  # its ANA group (1..ANAGRPMAX)


@dataclass
class SubsystemConfig:
    nqn: str
    namespaces: list[NamespaceConfig] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    allow_any_host: bool = False
    serial: str = ""
    model: str = "kvtool emulator"


@dataclass
class HostKeyConfig:
    """DH-HMAC-CHAP for one host NQN: key files (mode 0600), allowed hashes and DH groups."""

    nqn: str
    dhchap_key_file: str
    dhchap_ctrl_key_file: str | None = None  # set: the controller proves itself too
    dhchap_hashes: list[str] = field(default_factory=list)  # preference order; [] = all
    dhchap_dhgroups: list[str] = field(default_factory=list)


@dataclass
class EmulatorConfig:
    subsystems: list[SubsystemConfig] = field(default_factory=list)
    host_keys: list[HostKeyConfig] = field(default_factory=list)
    listen: list[str] = field(default_factory=lambda: [DEFAULT_LISTEN])
    allow_remote: bool = False
    port_id: int = 1
    mdts: int = 8  # max transfer 2^mdts × 4 KiB = 1 MiB
    max_queue_size: int = 128  # per queue; CAP.MQES = this − 1
    max_io_queues: int = 8
    in_capsule_data_size: int = 1 << 20  # I/O queues; IOCCSZ = (64 + this) / 16
    maxh2cdata: int = 1 << 20  # per H2CData PDU; data is streamed, never buffered whole
    kato_grace_s: float = 5.0  # slack past KATO (a TCG guest host can be late) before a drop
    # ANA state per listener and group: {"127.0.0.1:4421": {"1": "inaccessible"}}; a
    # (listener, group) not named is optimized. Re-read on SIGHUP (kvtool target ana).
    ana: dict[str, dict[str, str]] = field(default_factory=dict)
    # fault injection: listeners closed (connections dropped), as a port whose link is down
    closed: list[str] = field(default_factory=list)

    def validate(self, *, file: str | None = None) -> EmulatorConfig:
        """Check every field; return self. Raises InputError naming the field."""
        def bad(fld: str, msg: str) -> InputError:
            return InputError(msg, file=file, field=fld)

        if not self.listen:
            raise bad("listen", "at least one listen address is needed")
        for i, addr in enumerate(self.listen):
            host, _port = parse_listen(addr, field=f"listen[{i}]", file=file)
            if not self.allow_remote and not is_loopback(host):
                raise bad(f"listen[{i}]", f"{addr} is not a loopback address; binding it "
                          "needs allow_remote (--allow-remote)")
        if not 1 <= self.mdts <= MAX_MDTS:
            raise bad("mdts", f"must be 1..{MAX_MDTS} (max transfer 2^mdts × 4 KiB), "
                      f"got {self.mdts}")
        if not 2 <= self.max_queue_size <= 1024:
            raise bad("max_queue_size", f"must be 2..1024, got {self.max_queue_size}")
        if not 1 <= self.max_io_queues <= 64:
            raise bad("max_io_queues", f"must be 1..64, got {self.max_io_queues}")
        if not 0 <= self.in_capsule_data_size <= (16 << 20) or self.in_capsule_data_size % 16:
            raise bad("in_capsule_data_size", "must be a multiple of 16 in 0..16MiB, got "
                      f"{self.in_capsule_data_size}")
        if self.maxh2cdata < 4096 or self.maxh2cdata % 4 or self.maxh2cdata > (16 << 20):
            raise bad("maxh2cdata", "must be a multiple of 4 in 4096..16MiB, got "
                      f"{self.maxh2cdata}")
        if not 0 <= self.kato_grace_s < float("inf"):  # also refuses nan
            raise bad("kato_grace_s", f"must be a non-negative number, got {self.kato_grace_s}")
        if not 0 <= self.port_id <= 0xFFFE:
            raise bad("port_id", f"must be 0..65534, got {self.port_id}")
        self.ana_states()  # validates "ana"
        self.closed_indexes(file=file)
        if not self.subsystems:
            raise bad("subsystems", "at least one subsystem is needed")
        key_nqns: set[str] = set()
        for i, hk in enumerate(self.host_keys):
            check_nqn(hk.nqn, field=f"host_keys[{i}].nqn", file=file)
            if hk.nqn in key_nqns:
                raise bad(f"host_keys[{i}].nqn", f"duplicate host {hk.nqn}")
            key_nqns.add(hk.nqn)
            for j, name in enumerate(hk.dhchap_hashes):
                try:
                    hash_id(name)
                except ValueError as exc:
                    raise bad(f"host_keys[{i}].dhchap_hashes[{j}]", str(exc)) from None
            for j, name in enumerate(hk.dhchap_dhgroups):
                try:
                    dhgroup_id(name)
                except ValueError as exc:
                    raise bad(f"host_keys[{i}].dhchap_dhgroups[{j}]", str(exc)) from None
        seen: set[str] = set()
        for i, sub in enumerate(self.subsystems):
            where = f"subsystems[{i}]"
            check_nqn(sub.nqn, field=f"{where}.nqn", file=file)
            if sub.nqn == DISCOVERY_NQN:
                raise bad(f"{where}.nqn", "the discovery NQN cannot name an I/O subsystem")
            if sub.nqn in seen:
                raise bad(f"{where}.nqn", f"duplicate subsystem {sub.nqn}")
            seen.add(sub.nqn)
            if sub.allow_any_host and sub.hosts:
                raise bad(f"{where}.allow_any_host", "allow_any_host and an explicit host "
                          "list are mutually exclusive")
            for j, host in enumerate(sub.hosts):
                check_nqn(host, field=f"{where}.hosts[{j}]", file=file)
            if len(sub.serial) > 20 or not sub.serial.isascii():
                raise bad(f"{where}.serial", "at most 20 ASCII characters")
            if len(sub.model) > 40 or not sub.model.isascii():
                raise bad(f"{where}.model", "at most 40 ASCII characters")
            nsids: set[int] = set()
            if not sub.namespaces:
                raise bad(f"{where}.namespaces", "at least one namespace is needed")
            for j, ns in enumerate(sub.namespaces):
                nwhere = f"{where}.namespaces[{j}]"
                if not 1 <= ns.nsid <= 1024:
                    raise bad(f"{nwhere}.nsid", f"must be 1..1024, got {ns.nsid}")
                if ns.nsid in nsids:
                    raise bad(f"{nwhere}.nsid", f"duplicate namespace {ns.nsid}")
                nsids.add(ns.nsid)
                if ns.lba_size not in LBA_SIZES:
                    raise bad(f"{nwhere}.lba_size", f"must be 512 or 4096, got {ns.lba_size}")
                if not ns.backing:
                    raise bad(f"{nwhere}.backing", "a path or a size (e.g. 64MiB) is needed")
                if not 1 <= ns.anagrpid <= ANAGRPMAX:
                    raise bad(f"{nwhere}.anagrpid", f"must be 1..{ANAGRPMAX}, got {ns.anagrpid}")
        return self

    def closed_indexes(self, *, file: str | None = None) -> set[int]:
        where = {parse_listen(a, field="listen", file=file): i for i, a in enumerate(self.listen)}
        out = set()
        for j, addr in enumerate(self.closed):
            index = where.get(parse_listen(addr, field=f"closed[{j}]", file=file))
            if index is None:
                raise InputError(f"{addr} is not one of the listen addresses", file=file,
                                 field=f"closed[{j}]")
            out.add(index)
        return out

    def ana_states(self, *, file: str | None = None) -> dict[int, dict[int, int]]:
        """``ana`` as {listen index: {group: ANA state code}}; raises InputError naming the
        key when a listener is not in ``listen``, a group is out of range or a state unknown."""
        where = {parse_listen(a, field="listen", file=file): i for i, a in enumerate(self.listen)}
        out: dict[int, dict[int, int]] = {}
        for addr, groups in self.ana.items():
            fld = f"ana.{addr}"
            try:
                index = where[parse_listen(addr, field=fld, file=file)]
            except KeyError:
                raise InputError(f"{addr} is not one of the listen addresses "
                                 f"({', '.join(self.listen)})", file=file, field=fld) from None
            if not isinstance(groups, dict):
                raise InputError("expected an object {group: state}", file=file, field=fld)
            for grp, state in groups.items():
                if not str(grp).isdigit() or not 1 <= int(grp) <= ANAGRPMAX:
                    raise InputError(f"ANA group must be 1..{ANAGRPMAX}", file=file,
                                     field=f"{fld}.{grp}")
                if state not in ANA_STATES:
                    raise InputError(f"unknown ANA state {state!r} (one of "
                                     f"{', '.join(ANA_STATES)})", file=file, field=f"{fld}.{grp}")
                out.setdefault(index, {})[int(grp)] = ANA_STATES[state]
        return out

    @classmethod
    def from_dict(cls, doc: Any, *, file: str | None = None) -> EmulatorConfig:
        """Build from the JSON document; unknown keys and wrong types are errors naming the
        key (and ``file``)."""
        return cls.from_document(ConfigDocument(doc, file, "json", None))

    @classmethod
    def from_document(cls, doc: ConfigDocument) -> EmulatorConfig:
        """Build from a read document (:mod:`kvtool.configfile`: its typed reader checks
        every key), then :meth:`validate`."""
        top = doc.table()
        top.check_keys(_keys(cls))
        keys = [HostKeyConfig(
            nqn=t.text("nqn", required=True),
            dhchap_key_file=t.text("dhchap_key_file", required=True),
            dhchap_ctrl_key_file=_optional_text(t, "dhchap_ctrl_key_file"),
            dhchap_hashes=t.str_list("dhchap_hashes"),
            dhchap_dhgroups=t.str_list("dhchap_dhgroups"))
            for t in _checked(top.tables("host_keys"), HostKeyConfig)]
        subs = [SubsystemConfig(
            nqn=t.text("nqn", required=True),
            namespaces=[NamespaceConfig(
                nsid=n.integer("nsid", required=True), backing=n.text("backing", required=True),
                size=_size_text(n), lba_size=n.integer("lba_size", 512),
                anagrpid=n.integer("anagrpid", 1))
                for n in _checked(t.tables("namespaces"), NamespaceConfig)],
            hosts=t.str_list("hosts"), allow_any_host=t.flag("allow_any_host"),
            serial=t.text("serial", ""), model=t.text("model", "kvtool emulator"))
            for t in _checked(top.tables("subsystems"), SubsystemConfig)]
        defaults = cls()
        ana = top.table("ana")
        cfg = cls(
            subsystems=subs, host_keys=keys,
            listen=top.str_list("listen") if top.has("listen") else defaults.listen,
            allow_remote=top.flag("allow_remote"),
            port_id=top.integer("port_id", defaults.port_id),
            mdts=top.integer("mdts", defaults.mdts),
            max_queue_size=top.integer("max_queue_size", defaults.max_queue_size),
            max_io_queues=top.integer("max_io_queues", defaults.max_io_queues),
            in_capsule_data_size=top.integer("in_capsule_data_size",
                                             defaults.in_capsule_data_size),
            maxh2cdata=top.integer("maxh2cdata", defaults.maxh2cdata),
            kato_grace_s=top.number("kato_grace_s", defaults.kato_grace_s),
            ana=ana.data if ana is not None else {}, closed=top.str_list("closed"))
        return cfg.validate(file=doc.source)

    @classmethod
    def load(cls, path: str | Path) -> EmulatorConfig:
        """Read a JSON config file; every error names the file, the key's line and the key
        (kvtool.configfile, the reader every kvtool config file goes through)."""
        doc = read_config(path, kind="json")
        try:
            return cls.from_document(doc)
        except InputError as exc:
            raise doc.locate(exc) from None


def _keys(cls: type) -> list[str]:
    return list(cls.__dataclass_fields__)  # type: ignore[attr-defined]


def _checked(tables: list[ConfigTable], cls: type) -> list[ConfigTable]:
    """``tables``, each checked for keys ``cls`` does not have."""
    for t in tables:
        t.check_keys(_keys(cls))
    return tables


def _optional_text(t: ConfigTable, key: str) -> str | None:
    """A string, or None when absent or JSON null."""
    return None if t.data.get(key) is None else t.text(key)


def _size_text(t: ConfigTable) -> str | None:
    """``size``: a size such as "64MiB", or a byte count; kept as text for validate()."""
    value = t.data.get("size")
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return t.text("size")


def check_nqn(nqn: str, *, field: str, file: str | None = None) -> None:
    problem = nqn_problem(nqn)
    if problem:
        raise InputError(problem, file=file, field=field)


def parse_listen(addr: str, *, field: str = "listen",
                 file: str | None = None) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port); port 0 picks a free port."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise InputError(f"{addr!r} is not HOST:PORT", file=file, field=field)
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise InputError(f"{host!r} is not an IP address", file=file, field=field) from None
        host = "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InputError(f"{port!r} is not a TCP port", file=file, field=field)
    return host, int(port)


def simple_config(*, nqn: str, backing: str, size: str | None = None, lba_size: int = 512,
                  hosts: list[str] | None = None, allow_any_host: bool = False,
                  listen: list[str] | None = None, allow_remote: bool = False,
                  **limits: Any) -> EmulatorConfig:
    """One subsystem with one namespace (nsid 1): what the CLI flags describe."""
    sub = SubsystemConfig(nqn=nqn, namespaces=[NamespaceConfig(1, backing, size, lba_size)],
                          hosts=list(hosts or []), allow_any_host=allow_any_host)
    cfg = EmulatorConfig(subsystems=[sub], listen=list(listen or [DEFAULT_LISTEN]),
                       allow_remote=allow_remote, **limits)
    return cfg.validate()


__all__ = [
    "EmulatorConfig",
    "HostKeyConfig",
    "NamespaceConfig",
    "SubsystemConfig",
    "check_nqn",
    "parse_listen",
    "simple_config",
]
