"""A thin object model of the kernel nvmet configfs tree, one class per directory kind.

Mirrors nvmetcli's ``nvmet/nvme.py``: :class:`Root` (``/sys/kernel/config/nvmet``) holds
:class:`Subsystem` (with :class:`Namespace` children and ``allowed_hosts`` links),
:class:`Port` (with ``subsystems`` links) and :class:`Host`. Objects are handles: creating
one touches nothing; ``create()``/``delete()`` do the ``mkdir``/``rmdir``.

All I/O goes through :class:`ConfigFS`, which uses ``os.open``/``os.write`` so that the
kernel's errno surfaces at the call (configfs parses each ``write()`` on its own; a
buffered ``open().write()`` would only fail at close) and turns it into a
:class:`ConfigfsError` that explains the errno as nvmet means it
(Linux drivers/nvme/target/configfs.c; docs/target.md).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from kvtool.target.plan import TargetError

DEFAULT_ROOT = "/sys/kernel/config/nvmet"


class ConfigfsError(TargetError):
    """A configfs operation failed; ``errno`` is the kernel's, the message says why."""

    def __init__(self, op: str, path: str, err: int, explanation: str) -> None:
        self.op = op
        self.path = path
        self.errno = err
        name = errno.errorcode.get(err, str(err))
        super().__init__(f"{op} {path}: {name} ({os.strerror(err)}): {explanation}")


def explain(op: str, rel: str, err: int, value: str | None = None) -> str:
    """What an errno from nvmet configfs means for this operation (docs/target.md)."""
    parts = rel.split("/")
    leaf = parts[-1] if parts else ""
    top = parts[0] if parts else ""
    if err == errno.EACCES:
        if top == "ports" and leaf.startswith(("addr_", "param_")):
            return (f"port {parts[1]} is enabled (a subsystem is linked to it); unlink its "
                    "subsystems before changing addr_/param_ attributes")
        return "permission denied: nvmet configfs needs root"
    if err == errno.EBUSY:
        if op == "write" and leaf.startswith("device_"):
            return "the namespace is enabled; write 0 to 'enable' before changing it"
        if op == "write" and leaf == "enable":
            return ("the backing device is claimed exclusively by someone else (mounted, "
                    "or used by another namespace)")
        if op == "rmdir" and top == "subsystems":
            return "the subsystem is still linked from a port (ports/*/subsystems); unlink it first"
        if op == "rmdir" and top == "hosts":
            return "the host is still listed in a subsystem's allowed_hosts; unlink it first"
        return "the object is in use"
    if err == errno.ENOTEMPTY:
        if top == "subsystems":
            return "the subsystem still has namespaces or allowed_hosts entries; remove them first"
        if top == "ports":
            return "the port still has subsystem links, referrals or ANA groups; remove them first"
        return "the directory is not empty"
    if err == errno.EEXIST:
        return "it already exists"
    if err == errno.ENOENT:
        if op == "write" and leaf == "enable":
            return "the backing file or device does not exist"
        return "no such object (was it removed meanwhile, or is the nvmet module missing?)"
    if err == errno.EINVAL:
        if op == "symlink" and top == "ports":
            return ("the port could not be enabled: transport module not loaded, or "
                    "addr_trtype/adrfam/traddr/trsvcid invalid")
        if op == "symlink":
            return "the link is not allowed (allow_any_host=1 forbids explicit hosts, or wrong target)"
        if leaf == "attr_allow_any_host":
            return "explicit hosts are linked; unlink them before allowing any host"
        if leaf.startswith("attr_"):
            return ("value rejected (serial/model are fixed once a host has identified the "
                    "controller; check length and characters)")
        if leaf in ("dhchap_key", "dhchap_ctrl_key"):  # never echo a secret
            return "the DH-HMAC-CHAP secret was rejected (not a DHHC-1 key of 32/48/64 bytes?)"
        if leaf in ("dhchap_hash", "dhchap_dhgroup"):
            return f"{value!r} rejected (this kernel lacks that hash or DH group?)"
        if leaf in ("buffered_io", "resv_enable"):
            return "the namespace is enabled; disable it first"
        if op == "mkdir" and top == "subsystems" and len(parts) == 2:
            return "not an acceptable subsystem name (the discovery NQN is reserved)"
        if op == "mkdir":
            return "not an acceptable name (namespace ids are 1..0xFFFFFFFE, port ids 0..65535)"
        return f"value {value!r} rejected" if value is not None else "invalid argument"
    if err == errno.EADDRINUSE:
        return "the address and port are already in use by another listener"
    if err == errno.EADDRNOTAVAIL:
        return "that address is not configured on this machine"
    if err == errno.ENODEV:
        return "no RDMA device serves that address"
    if err == errno.ENOMEM:
        return "the kernel refused to allocate (too many namespaces?)"
    return os.strerror(err)


class ConfigFS:
    """Primitive operations on the nvmet configfs tree rooted at ``root``."""

    def __init__(self, root: str | os.PathLike[str] = DEFAULT_ROOT) -> None:
        self.root = Path(root)

    def path(self, rel: str) -> str:
        return str(self.root / rel) if rel else str(self.root)

    def _fail(self, op: str, rel: str, exc: OSError, value: str | None = None) -> ConfigfsError:
        err = exc.errno or errno.EIO
        return ConfigfsError(op, self.path(rel), err, explain(op, rel, err, value))

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._fail("list", rel, exc) from None

    def read(self, rel: str) -> str | None:
        """An attribute's value without the trailing newline; None when absent."""
        try:
            fd = os.open(self.path(rel), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._fail("read", rel, exc) from None
        try:
            chunks = []
            while True:
                b = os.read(fd, 65536)
                if not b:
                    break
                chunks.append(b)
            return b"".join(chunks).decode(errors="replace").rstrip("\n")
        except OSError as exc:
            raise self._fail("read", rel, exc) from None
        finally:
            os.close(fd)

    def write(self, rel: str, value: str) -> None:
        try:
            fd = os.open(self.path(rel), os.O_WRONLY)
        except OSError as exc:
            raise self._fail("write", rel, exc, value) from None
        try:
            os.write(fd, value.encode())
        except OSError as exc:
            raise self._fail("write", rel, exc, value) from None
        finally:
            os.close(fd)

    def mkdir(self, rel: str) -> None:
        try:
            os.mkdir(self.path(rel))
        except OSError as exc:
            raise self._fail("mkdir", rel, exc) from None

    def rmdir(self, rel: str) -> None:
        try:
            os.rmdir(self.path(rel))
        except OSError as exc:
            raise self._fail("rmdir", rel, exc) from None

    def symlink(self, target_rel: str, link_rel: str) -> None:
        try:
            os.symlink(self.path(target_rel), self.path(link_rel))
        except OSError as exc:
            raise self._fail("symlink", link_rel, exc) from None

    def unlink(self, link_rel: str) -> None:
        try:
            os.unlink(self.path(link_rel))
        except OSError as exc:
            raise self._fail("unlink", link_rel, exc) from None


class _Node:
    rel: str

    def __init__(self, cfs: ConfigFS) -> None:
        self.cfs = cfs

    @property
    def exists(self) -> bool:
        return self.cfs.exists(self.rel)

    def get(self, attr: str) -> str | None:
        return self.cfs.read(f"{self.rel}/{attr}")

    def set(self, attr: str, value: str) -> None:
        self.cfs.write(f"{self.rel}/{attr}", value)

    def has(self, attr: str) -> bool:
        return self.cfs.exists(f"{self.rel}/{attr}")

    def create(self) -> None:
        self.cfs.mkdir(self.rel)

    def delete(self) -> None:
        self.cfs.rmdir(self.rel)

    def attrs(self, prefix: str) -> dict[str, str]:
        """Readable attributes ``<prefix>_*`` with the prefix removed (nvmetcli grouping)."""
        out: dict[str, str] = {}
        for name in self.cfs.listdir(self.rel):
            if name.startswith(prefix + "_") and not os.path.isdir(self.cfs.path(f"{self.rel}/{name}")):
                v = self.get(name)
                if v is not None:
                    out[name[len(prefix) + 1:]] = v
        return out


class Host(_Node):
    def __init__(self, cfs: ConfigFS, nqn: str) -> None:
        super().__init__(cfs)
        self.nqn = nqn
        self.rel = f"hosts/{nqn}"


class Namespace(_Node):
    def __init__(self, cfs: ConfigFS, subsystem: str, nsid: int) -> None:
        super().__init__(cfs)
        self.subsystem = subsystem
        self.nsid = nsid
        self.rel = f"subsystems/{subsystem}/namespaces/{nsid}"

    @property
    def enabled(self) -> bool:
        return (self.get("enable") or "0").strip() in ("1", "Y", "y")

    @property
    def device_path(self) -> str:
        return self.get("device_path") or ""


class Subsystem(_Node):
    def __init__(self, cfs: ConfigFS, nqn: str) -> None:
        super().__init__(cfs)
        self.nqn = nqn
        self.rel = f"subsystems/{nqn}"

    def namespace(self, nsid: int) -> Namespace:
        return Namespace(self.cfs, self.nqn, nsid)

    def namespaces(self) -> list[Namespace]:
        ids = [int(n) for n in self.cfs.listdir(f"{self.rel}/namespaces") if n.isdigit()]
        return [self.namespace(n) for n in sorted(ids)]

    def allowed_hosts(self) -> list[str]:
        return self.cfs.listdir(f"{self.rel}/allowed_hosts")

    def allow_host(self, nqn: str) -> None:
        self.cfs.symlink(f"hosts/{nqn}", f"{self.rel}/allowed_hosts/{nqn}")

    def disallow_host(self, nqn: str) -> None:
        self.cfs.unlink(f"{self.rel}/allowed_hosts/{nqn}")

    @property
    def allow_any_host(self) -> bool:
        return (self.get("attr_allow_any_host") or "0").strip() in ("1", "Y", "y")


class Port(_Node):
    def __init__(self, cfs: ConfigFS, portid: int) -> None:
        super().__init__(cfs)
        self.portid = portid
        self.rel = f"ports/{portid}"

    def subsystems(self) -> list[str]:
        return self.cfs.listdir(f"{self.rel}/subsystems")

    def link(self, nqn: str) -> None:
        self.cfs.symlink(f"subsystems/{nqn}", f"{self.rel}/subsystems/{nqn}")

    def unlink(self, nqn: str) -> None:
        self.cfs.unlink(f"{self.rel}/subsystems/{nqn}")

    def referrals(self) -> list[str]:
        return self.cfs.listdir(f"{self.rel}/referrals")

    # ANA: ana_groups/<grpid>/ana_state; group 1 is the port's default group (always there,
    # optimized); a group made with mkdir starts inaccessible (drivers/nvme/target/configfs.c)
    def ana_groups(self) -> list[int]:
        return sorted(int(g) for g in self.cfs.listdir(f"{self.rel}/ana_groups") if g.isdigit())

    def ana_state(self, grpid: int) -> str | None:
        value = self.cfs.read(f"{self.rel}/ana_groups/{grpid}/ana_state")
        return value.strip() if value is not None else None

    def set_ana_state(self, grpid: int, state: str) -> None:
        self.cfs.write(f"{self.rel}/ana_groups/{grpid}/ana_state", state)

    def make_ana_group(self, grpid: int) -> None:
        self.cfs.mkdir(f"{self.rel}/ana_groups/{grpid}")

    def remove_ana_group(self, grpid: int) -> None:
        self.cfs.rmdir(f"{self.rel}/ana_groups/{grpid}")

    @property
    def enabled(self) -> bool:
        return bool(self.subsystems())

    def address(self) -> dict[str, str]:
        return self.attrs("addr")


class Root:
    """``/sys/kernel/config/nvmet`` (or a test tree): the entry to every object."""

    def __init__(self, cfs: ConfigFS) -> None:
        self.cfs = cfs

    @property
    def exists(self) -> bool:
        return os.path.isdir(self.cfs.path(""))

    def subsystem(self, nqn: str) -> Subsystem:
        return Subsystem(self.cfs, nqn)

    def subsystems(self) -> list[Subsystem]:
        return [self.subsystem(n) for n in self.cfs.listdir("subsystems")]

    def port(self, portid: int) -> Port:
        return Port(self.cfs, portid)

    def ports(self) -> list[Port]:
        ids = [int(p) for p in self.cfs.listdir("ports") if p.isdigit()]
        return [self.port(p) for p in sorted(ids)]

    def host(self, nqn: str) -> Host:
        return Host(self.cfs, nqn)

    def hosts(self) -> list[Host]:
        return [self.host(n) for n in self.cfs.listdir("hosts")]

    def hosts_in_use(self, excluding: set[str] = frozenset()) -> set[str]:  # type: ignore[assignment]
        """Host NQNs linked from the allowed_hosts of subsystems not in ``excluding``."""
        used: set[str] = set()
        for s in self.subsystems():
            if s.nqn not in excluding:
                used.update(s.allowed_hosts())
        return used

    def ports_linking(self, nqn: str) -> list[Port]:
        return [p for p in self.ports() if nqn in p.subsystems()]
