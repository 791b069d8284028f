"""The kernel's side of nvmet configfs, for tests on a pyfakefs tree.

This machine's kernel has no configfs/nvmet, so :class:`FakeNvmetKernel` plays the kernel:
it subclasses kvtool's real :class:`~kvtool.target.nvmet.configfs.ConfigFS` (whose ``os``
calls then run against pyfakefs) and, before each operation, applies the rules the kernel
applies (drivers/nvme/target/configfs.c, summarised in docs/target.md):

* ``mkdir`` of a subsystem/namespace/port/host auto-creates its attributes and default
  groups (``namespaces/``, ``allowed_hosts/``, ``passthru/``; ``subsystems/``, ``referrals/``,
  ``ana_groups/1``, optimized); names are validated (EINVAL); ``ports/N/ana_groups/G``
  (2..128) is made inaccessible; ``ana_state`` and ``ana_grpid`` writes are checked (EINVAL);
* EACCES for ``addr_*``/``param_*`` writes on an enabled port; EBUSY for ``device_*`` and
  EINVAL for ``buffered_io`` writes on an enabled namespace; EINVAL for allow_any_host=1
  with hosts linked and for host links when allow_any_host=1; EEXIST for duplicate links;
* ``enable=1`` opens the backing (ENOENT when missing, EBUSY when claimed exclusively);
* the first link into ``ports/N/subsystems`` enables the port: EINVAL for a bad
  trtype/adrfam/address, EADDRINUSE when another enabled port holds the address;
* ``rmdir``: EBUSY for a linked subsystem or host, ENOTEMPTY for a subsystem with
  namespaces/allowed hosts or a port with links/referrals; a removed object's
  auto-created children disappear with it.

``inject(op, suffix, errno)`` makes the next matching operation fail, for rollback tests.
"""

from __future__ import annotations

import errno
import os
import uuid as uuidlib

from kvtool.target.nvmet.configfs import ConfigFS, ConfigfsError, explain

ROOT = "/sys/kernel/config/nvmet"
TRTYPES = ("rdma", "fc", "tcp", "pci", "loop")
ADRFAMS = ("ipv4", "ipv6", "ib", "fc", "pci", "loop")
ANA_STATES = ("optimized", "non-optimized", "inaccessible", "persistent-loss", "change")


def _err(op: str, path: str, rel: str, code: int) -> ConfigfsError:
    return ConfigfsError(op, path, code, explain(op, rel, code))


class FakeNvmetKernel(ConfigFS):
    def __init__(self, root: str = ROOT) -> None:
        super().__init__(root)
        os.makedirs(root, exist_ok=True)
        for d in ("subsystems", "ports", "hosts"):
            os.makedirs(f"{root}/{d}", exist_ok=True)
        self._put("discovery_nqn", "nqn.2014-08.org.nvmexpress.discovery")
        self.claimed: set[str] = set()  # backing paths another user holds exclusively
        self.injected: list[tuple[str, str, int]] = []
        self.ops: list[tuple[str, str]] = []  # every operation kvtool performed, in order

    # ------------------------------------------------------------------ helpers
    def _put(self, rel: str, value: str) -> None:
        with open(self.path(rel), "w") as f:
            f.write(value + "\n")

    def _val(self, rel: str) -> str:
        with open(self.path(rel)) as f:
            return f.read().rstrip("\n")

    def inject(self, op: str, suffix: str, code: int) -> None:
        """Fail the next ``op`` whose path ends with ``suffix`` with ``code``."""
        self.injected.append((op, suffix, code))

    def _check_injected(self, op: str, rel: str) -> None:
        for i, (o, suffix, code) in enumerate(self.injected):
            if o == op and rel.endswith(suffix):
                del self.injected[i]
                raise _err(op, self.path(rel), rel, code)

    def _links_to(self, target_rel: str) -> list[str]:
        """Every symlink in the tree that points at ``target_rel``."""
        want = self.path(target_rel)
        found = []
        for dirpath, dirnames, filenames in os.walk(self.path("")):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                if os.path.islink(p) and os.readlink(p) == want:
                    found.append(p)
        return found

    def _port_enabled(self, portid: str) -> bool:
        return bool(os.listdir(self.path(f"ports/{portid}/subsystems")))

    def _ns_enabled(self, ns_rel: str) -> bool:
        return self._val(f"{ns_rel}/enable") == "1"

    # ------------------------------------------------------------------ operations
    def mkdir(self, rel: str) -> None:
        self.ops.append(("mkdir", rel))
        self._check_injected("mkdir", rel)
        parts = rel.split("/")
        path = self.path(rel)
        if os.path.lexists(path):
            raise _err("mkdir", path, rel, errno.EEXIST)
        if len(parts) == 2 and parts[0] == "subsystems":
            if parts[1] == self._val("discovery_nqn"):
                raise _err("mkdir", path, rel, errno.EINVAL)
            super().mkdir(rel)
            for d in ("namespaces", "allowed_hosts", "passthru"):
                os.mkdir(f"{path}/{d}")
            for attr, v in (("attr_allow_any_host", "0"), ("attr_serial", uuidlib.uuid4().hex[:16]),
                            ("attr_model", "Linux"), ("attr_version", "1.3"),
                            ("attr_cntlid_min", "1"), ("attr_cntlid_max", "65519")):
                self._put(f"{rel}/{attr}", v)
            return
        if len(parts) == 4 and parts[0] == "subsystems" and parts[2] == "namespaces":
            if not parts[3].isdigit() or not 0 < int(parts[3]) < 0xFFFFFFFF:
                raise _err("mkdir", path, rel, errno.EINVAL)
            super().mkdir(rel)
            for attr, v in (("device_path", ""), ("device_uuid", str(uuidlib.uuid4())),
                            ("device_nguid", "00000000-0000-0000-0000-000000000000"),
                            ("enable", "0"), ("buffered_io", "0"), ("ana_grpid", "1"),
                            ("resv_enable", "0")):
                self._put(f"{rel}/{attr}", v)
            return
        if len(parts) == 2 and parts[0] == "ports":
            if not parts[1].isdigit() or int(parts[1]) > 0xFFFF:
                raise _err("mkdir", path, rel, errno.EINVAL)
            super().mkdir(rel)
            for d in ("subsystems", "referrals", "ana_groups", "ana_groups/1"):
                os.mkdir(f"{path}/{d}")
            self._put(f"{rel}/ana_groups/1/ana_state", "optimized")
            for attr, v in (("addr_trtype", ""), ("addr_adrfam", ""), ("addr_traddr", ""),
                            ("addr_trsvcid", ""), ("addr_treq", "not specified"),
                            ("addr_tsas", "none"), ("param_inline_data_size", "-1"),
                            ("param_max_queue_size", "-1"), ("param_mdts", "-1")):
                self._put(f"{rel}/{attr}", v)
            return
        if len(parts) == 4 and parts[0] == "ports" and parts[2] == "ana_groups":
            if not parts[3].isdigit() or not 1 < int(parts[3]) <= 128:
                raise _err("mkdir", path, rel, errno.EINVAL)
            super().mkdir(rel)
            self._put(f"{rel}/ana_state", "inaccessible")  # a new group starts inaccessible
            return
        if len(parts) == 2 and parts[0] == "hosts":
            super().mkdir(rel)
            for attr in ("dhchap_key", "dhchap_ctrl_key", "dhchap_hash", "dhchap_dhgroup"):
                self._put(f"{rel}/{attr}", "")
            return
        raise _err("mkdir", path, rel, errno.EPERM)  # configfs: no mkdir outside groups

    def rmdir(self, rel: str) -> None:
        self.ops.append(("rmdir", rel))
        self._check_injected("rmdir", rel)
        parts = rel.split("/")
        path = self.path(rel)
        if not os.path.isdir(path) or os.path.islink(path):
            raise _err("rmdir", path, rel, errno.ENOENT)
        if len(parts) == 2 and parts[0] == "subsystems":
            if self._links_to(rel):
                raise _err("rmdir", path, rel, errno.EBUSY)
            if os.listdir(f"{path}/namespaces") or os.listdir(f"{path}/allowed_hosts"):
                raise _err("rmdir", path, rel, errno.ENOTEMPTY)
            self._remove_tree(path)
            return
        if len(parts) == 4 and parts[2] == "namespaces":
            self._remove_tree(path)  # enabled namespaces may be removed (release disables)
            return
        if len(parts) == 2 and parts[0] == "ports":
            if os.listdir(f"{path}/subsystems") or os.listdir(f"{path}/referrals") \
                    or set(os.listdir(f"{path}/ana_groups")) - {"1"}:
                raise _err("rmdir", path, rel, errno.ENOTEMPTY)
            self._remove_tree(path)
            return
        if len(parts) == 4 and parts[0] == "ports" and parts[2] == "ana_groups" \
                and parts[3] != "1":
            self._remove_tree(path)
            return
        if len(parts) == 2 and parts[0] == "hosts":
            if self._links_to(rel):
                raise _err("rmdir", path, rel, errno.EBUSY)
            self._remove_tree(path)
            return
        raise _err("rmdir", path, rel, errno.EPERM)

    def _remove_tree(self, path: str) -> None:
        for dirpath, dirnames, filenames in os.walk(path, topdown=False):
            for name in filenames:
                os.unlink(os.path.join(dirpath, name))
            for name in dirnames:
                p = os.path.join(dirpath, name)
                if os.path.islink(p):
                    os.unlink(p)
                else:
                    os.rmdir(p)
        os.rmdir(path)

    def write(self, rel: str, value: str) -> None:
        self.ops.append(("write", f"{rel}={value}"))
        self._check_injected("write", rel)
        parts = rel.split("/")
        leaf = parts[-1]
        path = self.path(rel)
        if not os.path.isfile(path):
            raise _err("write", path, rel, errno.ENOENT)
        if parts[0] == "ports" and len(parts) == 3:
            if leaf.startswith(("addr_", "param_")) and self._port_enabled(parts[1]):
                raise _err("write", path, rel, errno.EACCES)
            if leaf == "addr_trtype":
                if value not in TRTYPES:
                    raise _err("write", path, rel, errno.EINVAL)
                self._put(f"ports/{parts[1]}/addr_tsas", "none")
            if leaf == "addr_adrfam" and value not in ADRFAMS:
                raise _err("write", path, rel, errno.EINVAL)
            if (leaf == "addr_traddr" and len(value) > 256) or (leaf == "addr_trsvcid" and len(value) > 32):
                raise _err("write", path, rel, errno.EINVAL)
        if len(parts) == 5 and parts[2] == "namespaces":
            ns_rel = "/".join(parts[:4])
            enabled = self._ns_enabled(ns_rel)
            if leaf.startswith("device_") and enabled:
                raise _err("write", path, rel, errno.EBUSY)
            if leaf == "device_path" and not value:
                raise _err("write", path, rel, errno.EINVAL)
            if leaf in ("buffered_io", "resv_enable") and enabled:
                raise _err("write", path, rel, errno.EINVAL)
            if leaf == "enable":
                if value.strip() in ("1", "y", "Y"):
                    dev = self._val(f"{ns_rel}/device_path")
                    if not dev or not os.path.exists(dev):
                        raise _err("write", path, rel, errno.ENOENT)
                    if dev in self.claimed:
                        raise _err("write", path, rel, errno.EBUSY)
                    value = "1"
                else:
                    value = "0"
        if leaf == "ana_state" and value.strip() not in ANA_STATES:
            raise _err("write", path, rel, errno.EINVAL)
        if leaf == "ana_grpid" and (not value.strip().isdigit()
                                    or not 1 <= int(value) <= 128):
            raise _err("write", path, rel, errno.EINVAL)
        if (len(parts) == 3 and parts[0] == "subsystems" and leaf == "attr_allow_any_host"
                and value.strip() == "1"
                and os.listdir(self.path(f"subsystems/{parts[1]}/allowed_hosts"))):
            raise _err("write", path, rel, errno.EINVAL)
        self._put(rel, value)

    def symlink(self, target_rel: str, link_rel: str) -> None:
        self.ops.append(("symlink", link_rel))
        self._check_injected("symlink", link_rel)
        parts = link_rel.split("/")
        path = self.path(link_rel)
        if os.path.lexists(path):
            raise _err("symlink", path, link_rel, errno.EEXIST)
        tparts = target_rel.split("/")
        if parts[0] == "ports" and parts[2] == "subsystems":
            if tparts[0] != "subsystems" or not os.path.isdir(self.path(target_rel)):
                raise _err("symlink", path, link_rel, errno.EINVAL)
            portid = parts[1]
            if not self._port_enabled(portid):  # the first link enables the port
                port = f"ports/{portid}"
                tr, fam = self._val(f"{port}/addr_trtype"), self._val(f"{port}/addr_adrfam")
                addr, svc = self._val(f"{port}/addr_traddr"), self._val(f"{port}/addr_trsvcid")
                if tr not in TRTYPES or (tr in ("tcp", "rdma") and fam not in ("ipv4", "ipv6")) \
                        or not addr or not svc.isdigit():
                    raise _err("symlink", path, link_rel, errno.EINVAL)
                for other in os.listdir(self.path("ports")):
                    o = f"ports/{other}"
                    if other != portid and self._port_enabled(other) \
                            and self._val(f"{o}/addr_traddr") == addr \
                            and self._val(f"{o}/addr_trsvcid") == svc:
                        raise _err("symlink", path, link_rel, errno.EADDRINUSE)
        elif parts[0] == "subsystems" and parts[2] == "allowed_hosts":
            if tparts[0] != "hosts" or not os.path.isdir(self.path(target_rel)):
                raise _err("symlink", path, link_rel, errno.EINVAL)
            if self._val(f"subsystems/{parts[1]}/attr_allow_any_host") == "1":
                raise _err("symlink", path, link_rel, errno.EINVAL)
        else:
            raise _err("symlink", path, link_rel, errno.EPERM)
        super().symlink(target_rel, link_rel)

    def unlink(self, link_rel: str) -> None:
        self.ops.append(("unlink", link_rel))
        self._check_injected("unlink", link_rel)
        super().unlink(link_rel)


def snapshot(root: str = ROOT) -> dict[str, str]:
    """Every file, directory and link under ``root`` with its content or target."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "<dir>"
            else:
                with open(p) as f:
                    out[rel] = f.read()
    return out
