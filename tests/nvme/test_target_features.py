"""Target features a KV-store host uses beyond read/write: SMART counters, Write Zeroes,
Deallocate, Error Information, Commands Supported and Effects, Changed Namespace List and
its asynchronous event, and the Identify fields that advertise them. Real sockets, kvtool's
host against kvtool's target."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from emulator.nvmetcp import Target, simple_config
from kvtool.nvme import host, spec
from kvtool.nvme import pdu as P
from kvtool.nvme.queue import NvmeStatusError
from tests.nvme.conftest import HOST_A, NQN, NQN4K, make_config

pytestmark = pytest.mark.integration


def test_smart_data_units_are_live_and_rounded_up() -> None:
    with Target(make_config()) as t, \
            host.connect("127.0.0.1", t.port, NQN, hostnqn=HOST_A) as ctrl:
        before = ctrl.smart_log()
        assert before.data_units_written == before.data_units_read == 0
        ctrl.write(1, 0, b"\x01" * 512)  # one 512-byte unit: rounds up to 1
        s = ctrl.smart_log()
        assert (s.data_units_written, s.host_writes) == (1, 1)
        ctrl.write(1, 8, b"\x02" * (1000 * 512))  # 1001 units in all → 2
        ctrl.read(1, 0, 1)
        s = ctrl.smart_log()
        assert (s.data_units_written, s.host_writes) == (2, 2)
        assert (s.data_units_read, s.host_reads) == (1, 1)
        ctrl.write(2, 0, b"\x03" * 4096)
        assert ctrl.smart_log(nsid=2).host_writes == 1  # per namespace (LPA bit 0)
        assert ctrl.smart_log(nsid=1).host_writes == 2
        assert ctrl.smart_log().host_writes == 3
        with pytest.raises(NvmeStatusError) as e:
            ctrl.smart_log(nsid=9)
        assert e.value.sc == spec.SC_INVALID_NS
    with Target(make_config()) as t, \
            host.connect("127.0.0.1", t.port, NQN4K, hostnqn=HOST_A) as ctrl:
        ctrl.write(1, 0, b"\x04" * 4096 * 250)  # 2000 units of 512 B → exactly 2
        assert ctrl.smart_log().data_units_written == 2


def test_write_zeroes_and_deallocate_read_back_zeros() -> None:
    with Target(make_config()) as t, \
            host.connect("127.0.0.1", t.port, NQN, hostnqn=HOST_A) as ctrl:
        info = ctrl.identify_controller()
        assert info.oncs & spec.ONCS_DSM and info.oncs & spec.ONCS_WRITE_ZEROES
        assert ctrl.identify_namespace(1).dlfeat & 0x7 == spec.DLFEAT_READS_ZERO
        pattern = bytes(range(256)) * 2 * 64  # 64 blocks
        ctrl.write(1, 100, pattern)
        ctrl.write_zeroes(1, 110, 5)
        got = ctrl.read(1, 100, 64)
        assert got[:10 * 512] == pattern[:10 * 512]
        assert got[10 * 512: 15 * 512] == bytes(5 * 512)
        assert got[15 * 512:] == pattern[15 * 512:]
        ctrl.write(1, 100, pattern)
        ctrl.deallocate(1, [(101, 2), (130, 30)])  # 30 blocks: whole pages go back
        got = ctrl.read(1, 100, 64)
        assert got[512: 3 * 512] == bytes(1024) and got[30 * 512: 60 * 512] == bytes(15360)
        assert got[:512] == pattern[:512] and got[3 * 512: 30 * 512] == pattern[3 * 512:30 * 512]
        with pytest.raises(NvmeStatusError) as e:
            ctrl.deallocate(1, [(131070, 4)])
        assert e.value.sc == spec.SC_LBA_OUT_OF_RANGE
        with pytest.raises(NvmeStatusError) as e:
            ctrl.write_zeroes(2, 16383, 2)
        assert e.value.sc == spec.SC_LBA_OUT_OF_RANGE


def test_failed_commands_fill_the_error_log() -> None:
    with Target(make_config()) as t, \
            host.connect("127.0.0.1", t.port, NQN, hostnqn=HOST_A) as ctrl:
        info = ctrl.identify_controller()
        assert info.elpe == 127 and info.lpa & spec.LPA_EFFECTS
        assert info.ctratt & spec.CTRATT_HOST_ID_128
        with pytest.raises(NvmeStatusError) as e:
            ctrl.write_zeroes(2, 16384, 1)
        assert e.value.cqe.status & 0x4000  # More: see the Error Information log
        cid = e.value.cqe.cid
        page = ctrl.get_log_page(spec.LID_ERROR, 64 * 4)
        count, sqid, ecid, st, _loc, _lba, nsid = struct.unpack_from("<QHHHHQI", page, 0)
        assert (count, sqid, ecid, nsid) == (1, 1, cid, 2)
        assert (st >> 1) & 0xFF == spec.SC_LBA_OUT_OF_RANGE
        assert page[64:] == bytes(192)
        assert ctrl.smart_log().error_log_entries == 1


def test_effects_log_lists_what_is_implemented() -> None:
    with Target(make_config()) as t, \
            host.connect("127.0.0.1", t.port, NQN, hostnqn=HOST_A) as ctrl:
        page = ctrl.get_log_page(spec.LID_CMD_EFFECTS, 4096)
        acs = struct.unpack_from("<256I", page, 0)
        iocs = struct.unpack_from("<256I", page, 1024)
        assert {i for i, v in enumerate(acs) if v & 1} == {0x02, 0x06, 0x08, 0x09, 0x0A,
                                                            0x0C, 0x18}
        assert {i for i, v in enumerate(iocs) if v & 1} == {0x00, 0x01, 0x02, 0x08, 0x09}
        assert iocs[spec.IO_WRITE] & 2 and not iocs[spec.IO_READ] & 2


def test_namespace_added_while_connected_raises_the_notice() -> None:
    with Target(make_config()) as t, \
            host.connect("127.0.0.1", t.port, NQN, hostnqn=HOST_A) as ctrl:
        admin = ctrl.admin
        assert admin is not None
        admin.execute(P.Sqe(spec.ADMIN_SET_FEATURES, cdw10=spec.FID_ASYNC_EVENT_CONFIG,
                            cdw11=spec.AEN_CFG_NS_ATTR), what="Set Features AEC")
        aer = admin.submit(P.Sqe(spec.ADMIN_ASYNC_EVENT), what="AER")
        assert not aer.done.wait(0.2)  # nothing happened yet
        t.add_namespace(NQN, 5, "4MiB")
        assert aer.done.wait(5)
        dw0 = aer.result().dw0
        assert (dw0 & 0x7, (dw0 >> 16) & 0xFF) == (spec.AER_TYPE_NOTICE, spec.LID_CHANGED_NS)
        page = ctrl.get_log_page(spec.LID_CHANGED_NS, 4096)
        assert struct.unpack_from("<2I", page) == (5, 0)
        assert ctrl.get_log_page(spec.LID_CHANGED_NS, 4096) == bytes(4096)  # read clears
        assert 5 in ctrl.active_namespaces()
        ctrl.write(5, 0, b"\x05" * 512)
        aer2 = admin.submit(P.Sqe(spec.ADMIN_ASYNC_EVENT), what="AER")
        t.remove_namespace(NQN, 5)
        assert aer2.done.wait(5)
        assert struct.unpack_from("<I", ctrl.get_log_page(spec.LID_CHANGED_NS, 4096))[0] == 5
        assert 5 not in ctrl.active_namespaces()


def test_namespace_resized_while_connected(tmp_path: Path) -> None:
    backing = tmp_path / "ns.img"
    cfg = simple_config(nqn=NQN, backing=str(backing), size="1MiB", allow_any_host=True,
                        listen=["127.0.0.1:0"])
    with Target(cfg) as t, host.connect("127.0.0.1", t.port, NQN) as ctrl:
        admin = ctrl.admin
        assert admin is not None
        admin.execute(P.Sqe(spec.ADMIN_SET_FEATURES, cdw10=spec.FID_ASYNC_EVENT_CONFIG,
                            cdw11=spec.AEN_CFG_NS_ATTR), what="Set Features AEC")
        aer = admin.submit(P.Sqe(spec.ADMIN_ASYNC_EVENT), what="AER")
        ctrl.write(1, 2047, b"\x07" * 512)
        t.resize_namespace(NQN, 1, 2 << 20)
        assert aer.done.wait(5)
        assert ctrl.identify_namespace(1).nsze == 4096
        ctrl.write(1, 4095, b"\x08" * 512)  # the new last block
        assert ctrl.read(1, 2047, 1) == b"\x07" * 512
        assert backing.stat().st_size == 2 << 20
        with pytest.raises(ValueError):
            t.resize_namespace(NQN, 1, 1000)


@pytest.mark.parametrize("digests", [False, True])
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_large_in_capsule_writes_land_in_place(tmp_path: Path, kind: str,
                                               digests: bool) -> None:
    """Writes up to the 1 MiB in-capsule size go without an R2T; the data is received
    straight into the namespace (memory) or a pooled buffer (file), with digests checked."""
    backing = "8MiB" if kind == "memory" else str(tmp_path / "ns.img")
    cfg = simple_config(nqn=NQN, backing=backing, size=None if kind == "memory" else "8MiB",
                        allow_any_host=True, listen=["127.0.0.1:0"])
    data = bytes((i * 131) & 0xFF for i in range(1 << 20))
    with Target(cfg) as t, host.connect("127.0.0.1", t.port, NQN, header_digest=digests,
                                        data_digest=digests) as ctrl:
        assert ctrl.io[0].in_capsule_max == 1 << 20
        ctrl.write(1, 2048, data)
        ctrl.write(1, 100, data[:200 * 1024])
        assert ctrl.read(1, 2048, 2048) == data
        assert ctrl.read(1, 100, 400) == data[:200 * 1024]
        s = ctrl.smart_log()
        assert s.host_writes == 2 and s.data_units_written == 3  # 2448 units of 512 B
        with pytest.raises(NvmeStatusError) as e:  # out of range: not landed, refused
            ctrl.execute_io(P.Sqe(spec.IO_WRITE, nsid=1, cdw10=16384 - 100, cdw12=199),
                           "write past the end", data[: 200 * 512])
        assert e.value.sc == spec.SC_LBA_OUT_OF_RANGE
    if kind == "file":
        raw = (tmp_path / "ns.img").read_bytes()
        assert raw[2048 * 512: 4096 * 512] == data
