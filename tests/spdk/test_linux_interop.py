"""SPDK ↔ the real Linux kernel (6.1 in the QEMU guest), both directions, one guest boot.

(a) the guest kernel's nvme-tcp host → SPDK's nvmf_tgt on the host (reached through the
    guest's one forward, 10.0.2.100:PORT): nvme connect with and without digests, dd with
    O_DIRECT, read back, and kvtool's host reads the same bytes from SPDK afterwards;
(b) SPDK's hosts → the guest kernel's nvmet-tcp target (hostfwd on 127.0.0.1):
    spdk_nvme_identify and spdk_nvme_perf randrw.

No spdk_dd here: against the guest kernel, SPDK's host reuses an I/O queue's QID right
after freeing it, Linux 6.1 nvmet refuses the Connect ("qid 1 has already been created")
until it has torn the old queue down, bdev_nvme resets the controller, and spdk_dd, which
ignores the status of its bdev reads and writes (app/spdk_dd/spdk_dd.c,
_dd_read_bdev_done/_dd_write_bdev_done), copies zeros and exits 0. See docs/spdk.md.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from emulator.spdk import tools
from kvtool.nvme.host import connect
from kvtool.target.spdk.app import SpdkApp
from kvtool.target.spdk.install import SpdkInstall
from tests.conftest import free_port
from tests.helpers.guest_nvme import dmesg_tail, guest_sha256, kernel_connect, kernel_disconnect
from tests.helpers.qemu_guest import KernelTarget

pytestmark = [pytest.mark.spdk, pytest.mark.qemu, pytest.mark.integration, pytest.mark.slow]

SPDK_NQN = "nqn.2016-06.io.spdk:linux-interop"
KVTOOL_HOSTNQN = "nqn.2026-01.io.kvtool:host:spdk-interop"
# The guest image's own host NQN ends in "uuid:…kvt0", not a UUID: Linux nvmet takes it,
# SPDK refuses it (nvmf_subsystem_add_host: Internal error). The guest connects as this one.
GUEST_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:6b7e2a30-5d1c-4f0e-9a41-00000000c0de"
SPDK_PORT = free_port()  # reserved now: the guest's forward is fixed when it boots
MALLOC_BYTES = 64 << 20


@pytest.fixture(scope="module")
def kernel_target_options() -> dict[str, Any]:
    return {"guest_forwards": [SPDK_PORT]}


@pytest.fixture
def spdk_target(spdk: SpdkInstall) -> Iterator[SpdkApp]:
    """nvmf_tgt only while a test needs it (it busy-polls a core the guest wants too)."""
    app = SpdkApp(spdk, die_with_parent=True).start()
    try:
        app.rpc("nvmf_create_transport", {"trtype": "TCP"})
        app.rpc("bdev_malloc_create", {"name": "Mal0", "num_blocks": MALLOC_BYTES // 512,
                                       "block_size": 512})
        app.rpc("nvmf_create_subsystem", {"nqn": SPDK_NQN})
        app.rpc("nvmf_subsystem_add_ns", {"nqn": SPDK_NQN, "namespace": {"bdev_name": "Mal0"}})
        for host in (GUEST_HOSTNQN, KVTOOL_HOSTNQN):
            app.rpc("nvmf_subsystem_add_host", {"nqn": SPDK_NQN, "host": host})
        app.rpc("nvmf_subsystem_add_listener", {"nqn": SPDK_NQN, "listen_address": {
            "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
            "trsvcid": str(SPDK_PORT)}})
        yield app
    finally:
        app.stop()


@pytest.mark.parametrize("digests", [False, True], ids=["no-digest", "hdgst+ddgst"])
def test_linux_host_to_spdk_target(kernel_target: KernelTarget, spdk_target: SpdkApp,
                                   digests: bool) -> None:
    guest = kernel_target.guest
    base, length = (16 if digests else 0) << 20, 4 << 20
    dev = kernel_connect(guest, SPDK_PORT, SPDK_NQN, digests=digests, hostnqn=GUEST_HOSTNQN)
    try:
        assert int(guest.check(f"blockdev --getsize64 {dev}")) == MALLOC_BYTES
        ident = guest.check(f"nvme id-ctrl {dev[:-2]}")
        assert "SPDK bdev Controller" in ident, ident
        guest.check(f"head -c {length} /dev/urandom >/tmp/spdk-big")
        want = guest.check("sha256sum </tmp/spdk-big").split()[0]
        guest.check(f"dd if=/tmp/spdk-big of={dev} bs=1M seek={base >> 20} oflag=direct "
                    "conv=fsync", timeout=120)
        assert guest_sha256(guest, dev, base, length) == want
    except Exception:
        print(dmesg_tail(guest))
        raise
    finally:
        kernel_disconnect(guest, SPDK_NQN)
    _no_controllers_left(spdk_target)  # the kernel disconnected cleanly
    # a third party, kvtool's host, reads what the kernel wrote from SPDK's malloc bdev
    with connect("127.0.0.1", SPDK_PORT, SPDK_NQN, hostnqn=KVTOOL_HOSTNQN) as ctrl:
        got = ctrl.read(1, base // 512, length // 512)
    assert hashlib.sha256(got).hexdigest() == want
    _no_controllers_left(spdk_target)


def _no_controllers_left(app: SpdkApp) -> None:
    deadline = time.monotonic() + 10
    while app.rpc("nvmf_subsystem_get_controllers", {"nqn": SPDK_NQN}):
        assert time.monotonic() < deadline, "a host's controller outlived its disconnect"
        time.sleep(0.1)


def _kernel_trid(kt: KernelTarget) -> str:
    return tools.trid(kt.host, kt.port, kt.subnqn)


def test_spdk_identify_and_perf_against_linux_target(spdk: SpdkInstall,
                                                     kernel_target: KernelTarget) -> None:
    run = tools.identify(spdk, _kernel_trid(kernel_target))
    assert run.ok, run.output[-2000:]
    assert "Model Number:                          Linux" in run.output
    assert "Namespace ID:1" in run.output
    for io_size in (4096, 131072):
        result = tools.perf(spdk, _kernel_trid(kernel_target), workload="randrw", qd=32,
                            io_size=io_size, seconds=2)
        assert result.run.ok, result.run.errors or result.run.output[-2000:]
        assert result.iops > 0
