"""Read and validate a target config (TOML, or the same structure as JSON).

Every error is an :class:`~kvtool.errors.InputError` naming the file, the line and the
key (``demo.toml:14: field 'subsystem[0].namespace[1].nsid': duplicate NSID 1``), so the
CLI prints one line and exits 2 before anything is touched.

File format (docs/target.md has the full reference)::

    backend = "emulator"            # nvmet | spdk | emulator
    name = "demo"                   # state name (default: the file's stem)
    [emulator]
    runtime = "userspace"           # auto | kernel | qemu | userspace | spdk
    metrics_port = 9464             # userspace runtime: Prometheus metrics (0: any free port)
    busy_poll_us = 500              # userspace runtime: poll for events this long (0: never)
    [[subsystem]]
    nqn = "nqn.2026-01.io.kvtool:demo"
    hosts = ["nqn.2014-08.org.nvmexpress:uuid:..."]
      [[subsystem.namespace]]
      nsid = 1
      size = "256MiB"              # memory backing; or path = "...", backing = "file"|"block"
      lba = 512
    [[listener]]
    address = "127.0.0.1"
    port = 4420
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from pathlib import Path
from typing import Any

from kvtool.configfile import (
    ConfigDocument,
    ConfigTable,
    Locator,
    field_name,
    parse_config_text,
    read_config,
)
from kvtool.errors import InputError, param
from kvtool.nvme import dhchap
from kvtool.nvme.spec import DISCOVERY_NQN, is_loopback, nqn_problem
from kvtool.target.config import (
    ANA_GROUP_MAX,
    ANA_STATES,
    BACKENDS,
    BACKINGS,
    DEFAULT_PORT,
    MAX_BUSY_POLL_US,
    RUNTIMES,
    TRANSPORTS,
    Host,
    Listener,
    Namespace,
    NvmeAttach,
    Subsystem,
    TargetConfig,
    Transport,
)
from kvtool.target.nvmet.nvmetcli import looks_like_nvmetcli
from kvtool.target.nvmet.nvmetcli import to_config_dict as nvmetcli_to_config

_SERIAL_RE = re.compile(r"^[\x20-\x7e]{1,20}$")
_MODEL_RE = re.compile(r"^[\x20-\x7e]{1,40}$")
_UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_NGUID_RE = re.compile(r"^[0-9a-fA-F]{32}$")
_BDEV_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

TOP_KEYS = {"backend", "name", "emulator", "nvmet", "spdk", "host", "transport", "subsystem",
            "listener"}


LOCAL_HOST = "@local"  # in a hosts list: this machine's host NQN (kvtool.nvme.url)


def local_hostnqn() -> str:
    """This machine's host NQN, as kvtool's NVMe/TCP host and nvme-cli present it."""
    from kvtool.nvme.url import default_hostnqn
    return default_hostnqn()


def load_config(path: str | Path, *, backend: str | None = None, runtime: str | None = None,
                allow_remote: bool = False, check_paths: bool = True) -> TargetConfig:
    """Read, parse and validate a config file (``.toml``, or ``.json`` with the same keys).

    ``backend``/``runtime`` override the file's. ``check_paths`` checks backing files and
    devices on this machine (off when they live elsewhere, e.g. inside a QEMU guest).
    """
    p = Path(path)
    doc = read_config(p)
    return _from_document(doc, backend=backend, runtime=runtime, allow_remote=allow_remote,
                          check_paths=check_paths, default_name=p.stem)


def parse_config(text: str, *, source: str | None = None, backend: str | None = None,
                 runtime: str | None = None, allow_remote: bool = False, check_paths: bool = True,
                 is_json: bool = False, default_name: str = "target") -> TargetConfig:
    """Parse and validate config text; see :func:`load_config`."""
    doc = parse_config_text(text, source=source, kind="json" if is_json else "toml")
    return _from_document(doc, backend=backend, runtime=runtime, allow_remote=allow_remote,
                          check_paths=check_paths, default_name=default_name)


def _from_document(doc: ConfigDocument, *, backend: str | None, runtime: str | None,
                   allow_remote: bool, check_paths: bool, default_name: str) -> TargetConfig:
    source = doc.source
    data: Any = doc.data
    locator: Locator | None = doc.locator
    is_json = doc.kind == "json"
    if is_json and looks_like_nvmetcli(data):
        data = nvmetcli_to_config(data)
        locator = None  # nvmetcli's layout: its lines do not map onto kvtool's keys
    root = ConfigDocument(data, source, doc.kind, locator).table()
    cfg = _build(root, backend_override=backend, runtime_override=runtime,
                 default_name=default_name)
    cfg = _with_source(cfg, source, locator)
    validate(cfg, allow_remote=allow_remote, check_paths=check_paths)
    return cfg


def _with_source(cfg: TargetConfig, source: str | None, locator: Locator | None) -> TargetConfig:
    from dataclasses import replace
    return replace(cfg, source=source, locator=locator)


def _build(root: ConfigTable, *, backend_override: str | None, runtime_override: str | None,
           default_name: str) -> TargetConfig:
    root.check_keys(TOP_KEYS)
    backend = root.choice("backend", BACKENDS, "emulator")
    if backend_override is not None:
        backend = backend_override
    name = root.text("name", default_name) or default_name
    if not _NAME_RE.match(name):
        root.fail(f"name must be 1-64 of A-Z a-z 0-9 _ . -, got {name!r}", ("name",))

    runtime = "auto"
    metrics_port = None
    busy_poll_us = None
    emu = root.table("emulator")
    if emu is not None:
        emu.check_keys({"runtime", DEPRECATED_RUNTIME_KEY, "metrics_port", "busy_poll_us"})
        runtime = _runtime(emu)
        metrics_port = emu.integer("metrics_port", None, lo=0, hi=65535)
        busy_poll_us = emu.integer("busy_poll_us", None, lo=0, hi=MAX_BUSY_POLL_US)
    if runtime_override is not None:
        runtime = runtime_override
    userspace = backend == "emulator" and runtime in ("auto", "userspace")
    if metrics_port is not None and not userspace:
        assert emu is not None
        emu.fail("metrics_port applies to the emulator's userspace runtime only (the kernel, "
                 "QEMU and SPDK targets have no kvtool metrics)", ("emulator", "metrics_port"))
    if busy_poll_us is not None and not userspace:
        assert emu is not None
        emu.fail("busy_poll_us applies to the emulator's userspace runtime only (the kernel's "
                 "and SPDK's targets poll as they do)", ("emulator", "busy_poll_us"))

    nvmet_root = None
    nv = root.table("nvmet")
    if nv is not None:
        nv.check_keys({"configfs_root"})
        nvmet_root = nv.text("configfs_root")

    spdk = _spdk(root.table("spdk"))

    hosts = [_host(h) for h in root.tables("host")]
    transports = [_transport(t) for t in root.tables("transport")]
    subsystems = [_subsystem(s) for s in root.tables("subsystem")]
    if not subsystems:
        root.fail("the config defines no [[subsystem]]", ())
    all_nqns = [s.nqn for s in subsystems]
    listeners = [_listener(lst, i, all_nqns) for i, lst in enumerate(root.tables("listener"))]

    _check_unique(root, [h.nqn for h in hosts], ("host",), "nqn", "host NQN")
    _check_unique(root, [t.type for t in transports], ("transport",), "type", "transport")
    _check_unique(root, all_nqns, ("subsystem",), "nqn", "subsystem NQN")
    _check_unique(root, [lst.id for lst in listeners], ("listener",), "id", "listener id")
    _check_listeners(root, listeners, all_nqns)
    return TargetConfig(
        name=name, backend=backend, runtime=runtime,  # type: ignore[arg-type]
        metrics_port=metrics_port, busy_poll_us=busy_poll_us, subsystems=tuple(subsystems),
        listeners=tuple(listeners),
        hosts=tuple(hosts),
        transports=tuple(transports), nvmet_root=nvmet_root, **spdk)


def _spdk(sp: ConfigTable | None) -> dict[str, Any]:
    """The ``[spdk]`` table: :class:`TargetConfig`'s ``spdk_*`` fields (their defaults
    without one)."""
    spdk_socket, spdk_timeout = None, 60.0
    spdk_start, spdk_mem_mb, spdk_cpumask, spdk_pci_driver = False, None, None, "vfio-pci"
    if sp is not None:
        sp.check_keys({"socket", "timeout", "start", "mem_mb", "cpumask", "pci_driver"})
        spdk_socket = sp.text("socket")
        spdk_timeout = float(sp.integer("timeout", 60, lo=1, hi=3600) or 60)
        spdk_start = sp.flag("start", False)
        spdk_mem_mb = sp.integer("mem_mb", None, lo=256, hi=1 << 20)
        spdk_cpumask = sp.text("cpumask")
        if spdk_cpumask is not None and re.fullmatch(r"0x[0-9a-fA-F]{1,16}", spdk_cpumask) is None:
            sp.fail(f"cpumask must be a hex core mask such as 0x1, got {spdk_cpumask!r}",
                    ("spdk", "cpumask"))
        spdk_pci_driver = sp.choice("pci_driver", ("vfio-pci", "uio_pci_generic"),
                                    "vfio-pci") or "vfio-pci"
        if not spdk_start and any(sp.has(k) for k in ("mem_mb", "cpumask", "pci_driver")):
            only = next(k for k in ("mem_mb", "cpumask", "pci_driver") if sp.has(k))
            sp.fail(f"{only} applies when kvtool starts nvmf_tgt itself (start = true)",
                    ("spdk", only))
    return {"spdk_socket": spdk_socket, "spdk_timeout": spdk_timeout, "spdk_start": spdk_start,
            "spdk_mem_mb": spdk_mem_mb, "spdk_cpumask": spdk_cpumask,
            "spdk_pci_driver": spdk_pci_driver}


def _check_listeners(root: ConfigTable, listeners: list[Listener], all_nqns: list[str]) -> None:
    """Listeners: no two on one transport, address and port; each names only subsystems
    the config defines."""
    seen: dict[tuple[str, str, int], int] = {}
    for i, lst in enumerate(listeners):
        key = (lst.transport, str(ipaddress.ip_address(lst.address)), lst.port)
        if key in seen:
            root.fail(f"port clash: {lst.transport} {lst.address}:{lst.port} is already "
                      f"listener[{seen[key]}]", ("listener", i, "port"))
        seen[key] = i
    for i, lst in enumerate(listeners):
        for j, nqn in enumerate(lst.subsystems):
            if nqn not in all_nqns:
                root.fail(f"no [[subsystem]] has nqn {nqn!r}", ("listener", i, "subsystems", j))


DEPRECATED_RUNTIME_KEY = "engine"
"""``[emulator] engine``: the old name of ``[emulator] runtime``, still read (with a note)."""


def _runtime(emu: ConfigTable) -> str:
    """``[emulator] runtime``, or its deprecated name ``engine`` with a one-line warning on
    the ``kvtool.target`` logger (stderr when nothing configures logging)."""
    import logging

    key = "runtime"
    if emu.has(DEPRECATED_RUNTIME_KEY):
        if emu.has("runtime"):
            emu.fail("give runtime only (engine is its deprecated name)",
                     emu.at(DEPRECATED_RUNTIME_KEY))
        key = DEPRECATED_RUNTIME_KEY
        doc = emu.doc
        where = ":".join(str(x) for x in (doc.source, doc.line(emu.at(key))) if x is not None)
        logging.getLogger("kvtool.target").warning(
            "%s[emulator] engine is deprecated: call it runtime (same values)",
            f"{where}: " if where else "")
    return emu.choice(key, RUNTIMES, "auto") or "auto"


def _check_unique(root: ConfigTable, values: list[Any], table: tuple[str, ...], key: str,
                  what: str) -> None:
    first: dict[Any, int] = {}
    for i, v in enumerate(values):
        if v in first:
            root.fail(f"duplicate {what} {v!r} (first in {table[-1]}[{first[v]}])", (*table, i, key))
        first[v] = i


def _nqn(r: ConfigTable, key: str, value: str | None, path: tuple[str | int, ...]) -> str:
    if value is None:
        r.fail(f"missing required key {key!r}", path)
    assert value is not None
    problem = nqn_problem(value)
    if problem:
        r.fail(problem, path)
    return value


def _host(r: ConfigTable) -> Host:
    r.check_keys({"nqn", "dhchap_key", "dhchap_ctrl_key", "dhchap_key_file",
                  "dhchap_ctrl_key_file", "dhchap_hashes", "dhchap_dhgroups"})
    nqn = _nqn(r, "nqn", r.text("nqn", required=True), (*r.path, "nqn"))
    for inline in ("dhchap_key", "dhchap_ctrl_key"):
        if r.has(inline):  # the message must not repeat the value
            r.fail(f"secrets are not written into configs (they would reach the state file and "
                   f"plans): put it in a key file with mode 0600 (kvtool target keygen) and "
                   f"name that with {inline}_file", (*r.path, inline))
    key = _key_path(r, "dhchap_key_file")
    ctrl = _key_path(r, "dhchap_ctrl_key_file")
    if ctrl is not None and key is None:
        r.fail("dhchap_ctrl_key_file needs dhchap_key_file (bidirectional authentication "
               "authenticates the host too)", (*r.path, "dhchap_ctrl_key_file"))
    hashes = _algorithms(r, "dhchap_hashes", dhchap.hash_id, dhchap.HASHES)
    groups = _algorithms(r, "dhchap_dhgroups", dhchap.dhgroup_id, dhchap.DHGROUPS)
    if (hashes or groups) and key is None:
        r.fail("applies to a host with dhchap_key_file",
               (*r.path, "dhchap_hashes" if hashes else "dhchap_dhgroups"))
    return Host(nqn=nqn, dhchap_key_file=key, dhchap_ctrl_key_file=ctrl,
                dhchap_hashes=hashes, dhchap_dhgroups=groups)


def _key_path(r: ConfigTable, key: str) -> str | None:
    """A key file path; relative paths are relative to the config file's directory."""
    path = r.text(key)
    if path is None:
        return None
    if not path:
        r.fail("expected a path to a key file", (*r.path, key))
    if not os.path.isabs(path) and r.doc.source:
        path = str(Path(r.doc.source).resolve().parent / path)
    return path


def _algorithms(r: ConfigTable, key: str, parse: Any, names: Any) -> tuple[str, ...]:
    out = []
    for i, name in enumerate(r.str_list(key)):
        try:
            ident = parse(name)
        except ValueError as exc:
            r.fail(str(exc), (*r.path, key, i))
        value = names[ident].name if key == "dhchap_hashes" else names[ident]
        if value in out:
            r.fail(f"{name!r} listed twice", (*r.path, key, i))
        out.append(value)
    return tuple(out)


def _transport(r: ConfigTable) -> Transport:
    r.check_keys({"type", "io_unit_size", "in_capsule_data_size", "max_io_size",
                  "max_queue_depth", "max_io_qpairs_per_ctrlr"})
    trtype = r.choice("type", TRANSPORTS, "tcp") or "tcp"
    t = Transport(
        type=trtype,
        io_unit_size=r.size("io_unit_size"),
        in_capsule_data_size=r.size("in_capsule_data_size"),
        max_io_size=r.size("max_io_size"),
        max_queue_depth=r.integer("max_queue_depth", lo=2, hi=65535),
        max_io_qpairs_per_ctrlr=r.integer("max_io_qpairs_per_ctrlr", lo=1, hi=65535),
    )
    if t.io_unit_size is not None and t.io_unit_size % 512:
        r.fail("io_unit_size must be a multiple of 512", (*r.path, "io_unit_size"))
    if t.max_io_size is not None and t.io_unit_size is not None and t.max_io_size < t.io_unit_size:
        r.fail("max_io_size must be at least io_unit_size", (*r.path, "max_io_size"))
    return t


def _subsystem(r: ConfigTable) -> Subsystem:
    r.check_keys({"nqn", "namespace", "hosts", "allow_any_host", "serial", "model",
                  "max_namespaces"})
    nqn = _nqn(r, "nqn", r.text("nqn", required=True), (*r.path, "nqn"))
    if nqn == DISCOVERY_NQN:
        r.fail("the discovery NQN cannot be a subsystem", (*r.path, "nqn"))
    hosts = [local_hostnqn() if h == LOCAL_HOST else h for h in r.str_list("hosts")]
    for i, h in enumerate(hosts):
        _nqn(r, "hosts", h, (*r.path, "hosts", i))
    if len(set(hosts)) != len(hosts):
        dup = next(h for h in hosts if hosts.count(h) > 1)
        r.fail(f"host {dup!r} listed twice", (*r.path, "hosts", len(hosts) - 1 - hosts[::-1].index(dup)))
    allow_any = r.flag("allow_any_host", False)
    if allow_any and hosts:
        r.fail("allow_any_host = true and a hosts list are mutually exclusive "
               "(the kernel refuses both, EINVAL)", (*r.path, "allow_any_host"))
    if not allow_any and not hosts:
        r.fail("no host may connect: list the allowed host NQNs in hosts (\"@local\" is this "
               "machine's), or set allow_any_host = true", (*r.path, "hosts"))
    serial = r.text("serial")
    if serial is not None and not _SERIAL_RE.match(serial):
        r.fail("serial must be 1-20 printable ASCII characters", (*r.path, "serial"))
    model = r.text("model")
    if model is not None and not _MODEL_RE.match(model):
        r.fail("model must be 1-40 printable ASCII characters", (*r.path, "model"))
    namespaces = [_namespace(n) for n in r.tables("namespace")]
    first: dict[int, int] = {}
    for i, ns in enumerate(namespaces):
        if ns.nsid in first:
            r.fail(f"duplicate NSID {ns.nsid} (first in namespace[{first[ns.nsid]}])",
                   (*r.path, "namespace", i, "nsid"))
        first[ns.nsid] = i
    max_ns = r.integer("max_namespaces", lo=1, hi=1024)
    if max_ns is not None and namespaces and max(first) > max_ns:
        r.fail(f"max_namespaces {max_ns} is below the highest NSID {max(first)}",
               (*r.path, "max_namespaces"))
    return Subsystem(nqn=nqn, namespaces=tuple(namespaces), hosts=tuple(hosts),
                     allow_any_host=allow_any, serial=serial, model=model, max_namespaces=max_ns)


def _namespace(r: ConfigTable) -> Namespace:
    r.check_keys({"nsid", "backing", "path", "size", "create", "lba", "bdev", "bdev_name",
                  "uuid", "nguid", "buffered_io", "nvme", "ana_group"})
    nsid = r.integer("nsid", required=True, lo=1, hi=0xFFFFFFFE)
    assert nsid is not None
    path = r.text("path")
    nvme_tab = r.table("nvme")
    default_backing = "nvme" if nvme_tab is not None else ("file" if path else "memory")
    backing = r.choice("backing", BACKINGS, default_backing) or default_backing
    size = r.size("size")
    create = r.flag("create", False)
    lba = r.integer("lba")
    if lba is not None and lba not in (512, 4096):
        r.fail(f"lba must be 512 or 4096, got {lba}", (*r.path, "lba"))
    bdev_module = r.choice("bdev", ("aio", "uring"), "aio") or "aio"
    bdev_name = r.text("bdev_name")
    if bdev_name is not None and not _BDEV_NAME_RE.match(bdev_name):
        r.fail("bdev_name must be 1-64 of A-Z a-z 0-9 _ . -", (*r.path, "bdev_name"))
    uuid = r.text("uuid")
    if uuid is not None and not _UUID_RE.match(uuid):
        r.fail("expected a UUID like 3f1c...-....-....-....-............", (*r.path, "uuid"))
    nguid = r.text("nguid")
    if nguid is not None:
        nguid = nguid.replace("-", "").replace(":", "")
        if not _NGUID_RE.match(nguid):
            r.fail("nguid must be 32 hex digits", (*r.path, "nguid"))
    buffered = r.flag("buffered_io", False)
    ana_group = r.integer("ana_group", lo=1, hi=ANA_GROUP_MAX)
    nvme = None
    if backing == "memory":
        if path is not None:
            r.fail("a memory namespace has no path (use backing = \"file\")", (*r.path, "path"))
        if size is None:
            r.fail("a memory namespace needs size (e.g. size = \"1GiB\")", (*r.path, "size"))
        if create:
            r.fail("create applies to file namespaces only", (*r.path, "create"))
    elif backing in ("file", "block"):
        if path is None:
            r.fail(f"a {backing} namespace needs path", (*r.path, "path"))
        assert path is not None
        if not os.path.isabs(path):
            r.fail(f"path must be absolute, got {path!r}", (*r.path, "path"))
        if backing == "block" and create:
            r.fail("create applies to file namespaces only", (*r.path, "create"))
        if create and size is None:
            r.fail("create = true needs size", (*r.path, "size"))
    else:  # nvme
        if nvme_tab is None:
            r.fail("an nvme namespace needs an [nvme] table (trtype, traddr)", (*r.path, "nvme"))
        assert nvme_tab is not None
        nvme_tab.check_keys({"trtype", "traddr", "adrfam", "trsvcid", "subnqn", "namespace"})
        trtype = nvme_tab.choice("trtype", ("pcie", "tcp", "rdma"), "pcie") or "pcie"
        nvme = NvmeAttach(
            trtype={"pcie": "PCIe", "tcp": "TCP", "rdma": "RDMA"}[trtype],
            traddr=nvme_tab.text("traddr", required=True) or "",
            adrfam=nvme_tab.text("adrfam"), trsvcid=nvme_tab.text("trsvcid"),
            subnqn=nvme_tab.text("subnqn"), namespace=nvme_tab.integer("namespace", 1, lo=1) or 1)
        if path is not None or size is not None:
            r.fail("an nvme namespace takes neither path nor size", (*r.path, "path"))
    if size is not None and lba is not None and size % lba:
        r.fail(f"size {size} is not a multiple of lba {lba}", (*r.path, "size"))
    if size is not None and size % 512:
        r.fail(f"size {size} is not a multiple of 512", (*r.path, "size"))
    return Namespace(nsid=nsid, backing=backing, path=path, size=size,  # type: ignore[arg-type]
                     create=create, lba=lba, bdev_module=bdev_module,  # type: ignore[arg-type]
                     bdev_name=bdev_name, uuid=uuid, nguid=nguid, buffered_io=buffered, nvme=nvme,
                     ana_group=ana_group)


def _listener(r: ConfigTable, index: int, all_nqns: list[str]) -> Listener:
    r.check_keys({"id", "transport", "address", "port", "subsystems", "inline_data_size", "ana"})
    lid = r.integer("id", index + 1, lo=0, hi=65535)
    transport = r.choice("transport", TRANSPORTS, "tcp") or "tcp"
    address = r.text("address", "127.0.0.1") or "127.0.0.1"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        r.fail(f"address must be an IPv4 or IPv6 literal, got {address!r}", (*r.path, "address"))
    port = r.integer("port", DEFAULT_PORT, lo=1, hi=65535)
    subsystems = r.str_list("subsystems") if r.has("subsystems") else list(all_nqns)
    if not subsystems:
        r.fail("a listener needs at least one subsystem", (*r.path, "subsystems"))
    inline = r.size("inline_data_size")
    ana: list[tuple[int, str]] = []
    tab = r.table("ana")
    if tab is not None:  # ana = { 1 = "optimized", 2 = "inaccessible" }
        for key in tab.data:
            if not str(key).isdigit() or not 1 <= int(key) <= ANA_GROUP_MAX:
                tab.fail(f"an ANA group is 1..{ANA_GROUP_MAX}, got {key!r}", (*tab.path, key))
            state = tab.choice(key, ANA_STATES)
            assert state is not None
            ana.append((int(key), state))
    return Listener(id=lid or 0, transport=transport, address=address, port=port or DEFAULT_PORT,
                    family="ipv4" if ip.version == 4 else "ipv6",
                    subsystems=tuple(subsystems), inline_data_size=inline,
                    ana=tuple(sorted(ana)))


def validate(cfg: TargetConfig, *, allow_remote: bool = False, check_paths: bool = True) -> None:
    """Checks that depend on the machine or the backend (run again by ``up`` itself)."""
    def fail(message: str, *path: str | int) -> None:
        file, line = cfg.where(*path)
        raise InputError(message, file=file, line=line, field=field_name(path))

    if cfg.spdk_start and cfg.backend != "spdk":
        fail(f"start = true starts SPDK's nvmf_tgt: it needs backend = \"spdk\" (this config "
             f"is {cfg.backend})", "spdk", "start")
    for i, lst in enumerate(cfg.listeners):
        if not allow_remote and not is_loopback(lst.address):
            fail(f"address {lst.address} is not local: targets listen on loopback unless "
                 f"{param('allow_remote')} is given", "listener", i, "address")
        if lst.transport == "rdma" and cfg.backend == "emulator":
            fail("the emulator speaks NVMe/TCP only", "listener", i, "transport")
    for si, sub in enumerate(cfg.subsystems):
        for ni, ns in enumerate(sub.namespaces):
            at = ("subsystem", si, "namespace", ni)
            if cfg.backend == "nvmet" and ns.backing in ("memory", "nvme"):
                fail(f"the nvmet backend cannot serve a {ns.backing} namespace: give a path to a "
                     "block device or file (e.g. /dev/ram0, or a file on tmpfs with "
                     "buffered_io = true)", *at, "backing")
            if cfg.backend == "emulator" and ns.backing == "nvme":
                fail("the emulator cannot attach NVMe controllers (SPDK only)", *at, "backing")
            if cfg.backend == "spdk" and ns.buffered_io:
                fail("buffered_io is an nvmet option", *at, "buffered_io")
            if check_paths and ns.backing in ("file", "block") and ns.path is not None:
                _check_backing(ns, fail, at)
    if check_paths:
        for i, h in enumerate(cfg.hosts):
            for attr, path in (("dhchap_key_file", h.dhchap_key_file),
                               ("dhchap_ctrl_key_file", h.dhchap_ctrl_key_file)):
                if path is not None:
                    try:
                        dhchap.load_secret_file(path, field=attr)
                    except InputError as exc:
                        fail(exc.message, "host", i, attr)
    for si, sub in enumerate(cfg.subsystems):
        if sub.allow_any_host and cfg.host_keys():  # nvmet and SPDK skip auth for such hosts
            fail("a subsystem that allows any host authenticates nobody: list its hosts "
                 "(their [[host]] keys then apply)", "subsystem", si, "allow_any_host")
    for i, t in enumerate(cfg.transports):
        if cfg.backend != "spdk" and (t.io_unit_size or t.max_io_size or t.max_queue_depth
                                      or t.max_io_qpairs_per_ctrlr):
            fail("io_unit_size, max_io_size, max_queue_depth and max_io_qpairs_per_ctrlr are "
                 "SPDK transport options", "transport", i)


def _check_backing(ns: Namespace, fail: Any, at: tuple[str | int, ...]) -> None:
    assert ns.path is not None
    try:
        st = os.stat(ns.path)
    except FileNotFoundError:
        if ns.backing == "file" and ns.create:
            parent = os.path.dirname(ns.path) or "/"
            if not os.path.isdir(parent):
                fail(f"cannot create {ns.path}: directory {parent} does not exist", *at, "path")
            return
        fail(f"backing path {ns.path} does not exist"
             + (" (add create = true and size to create it)" if ns.backing == "file" else ""),
             *at, "path")
        return
    except OSError as exc:
        fail(f"cannot stat {ns.path}: {exc.strerror}", *at, "path")
        return
    if ns.backing == "block" and not stat.S_ISBLK(st.st_mode):
        fail(f"{ns.path} is not a block device", *at, "path")
    if ns.backing == "file" and not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        fail(f"{ns.path} is neither a regular file nor a block device", *at, "path")
