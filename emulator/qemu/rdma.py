"""Soft-RoCE in kvtool's QEMU guest: an ``rxe`` device on the guest's interface.

A guest booted with ``rdma=True`` has ``rdma_rxe`` (and ``crc32_generic``, its ICRC),
``ib_uverbs``, ``rdma_ucm``, ``nvme-rdma`` and ``nvmet-rdma`` loaded (emulator/qemu/init.sh);
every module comes from Debian's own kernel package, none is built. ``add_rxe`` makes an
RDMA device on ``eth0`` with iproute2's ``rdma link add`` (the host's ``/usr/bin/rdma``
through ``hostroot``), as SPDK's test/nvmf/common.sh does for its soft-RoCE CI.

RDMA traffic stays inside the guest: the rxe device is bound to the guest's own address
(10.0.2.15, ``emulator.qemu.guest.GUEST_ADDR``), a connection to it is looped back by the
guest kernel, and the user-mode network behind eth0 stays ``restrict=on``.
"""

from __future__ import annotations

import re
from typing import Protocol


class _Shell(Protocol):
    def exec(self, shell: str, timeout: float = 60.0) -> tuple[int, str]: ...

    def check(self, shell: str, timeout: float = 60.0) -> str: ...


RDMA = "chroot /hostroot /usr/bin/rdma"


def rxe_links(guest: _Shell) -> list[str]:
    """The RDMA links of the guest (``rxe0/1`` …), from ``rdma link show``."""
    rc, out = guest.exec(f"{RDMA} link show")
    if rc != 0:
        raise RuntimeError(f"rdma link show failed: {out.strip()}")
    return re.findall(r"^link (\S+)", out, re.M)


def add_rxe(guest: _Shell, name: str = "rxe0", netdev: str = "eth0") -> None:
    """``rdma link add NAME type rxe netdev NETDEV`` in the guest (a no-op when it exists)."""
    if any(link.split("/")[0] == name for link in rxe_links(guest)):
        return
    guest.check(f"{RDMA} link add {name} type rxe netdev {netdev}")


def del_rxe(guest: _Shell, name: str = "rxe0") -> None:
    """``rdma link delete NAME`` (a no-op when it is not there)."""
    if any(link.split("/")[0] == name for link in rxe_links(guest)):
        guest.check(f"{RDMA} link delete {name}")
