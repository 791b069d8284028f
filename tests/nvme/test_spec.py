"""NVMe structures: Identify Controller/Namespace, namespace lists, discovery log."""

from __future__ import annotations

import struct

from kvtool.nvme import spec


def test_identify_controller_offsets_and_round_trip() -> None:
    info = spec.ControllerInfo(
        vid=0x1B36, ssvid=0, sn="SN123", mn="kvtool emulator", fr="0.1.0", mdts=5, cntlid=7,
        ver=spec.vs_value(1, 3), cntrltype=1, kas=10, sqes=0x66, cqes=0x44, maxcmd=128,
        nn=1024, oncs=0, vwc=1, sgls=(1 << 0) | (1 << 20), subnqn="nqn.2026-01.io.kvtool:x",
        ioccsz=516, iorcsz=1, icdoff=0, msdbd=1)
    raw = info.encode()
    assert len(raw) == 4096
    assert raw[4:9] == b"SN123" and raw[9:24] == b" " * 15  # space padded
    assert raw[77] == 5 and struct.unpack_from("<H", raw, 78)[0] == 7
    assert struct.unpack_from("<I", raw, 80)[0] == 0x00010300
    assert raw[111] == 1 and raw[512] == 0x66 and raw[513] == 0x44
    assert struct.unpack_from("<HI", raw, 514) == (128, 1024)
    assert struct.unpack_from("<I", raw, 536)[0] == 0x100001
    assert raw[768:791] == b"nqn.2026-01.io.kvtool:x"
    assert struct.unpack_from("<IIH", raw, 1792) == (516, 1, 0) and raw[1803] == 1
    back = spec.ControllerInfo.decode(raw)
    assert back.mn == "kvtool emulator" and back.subnqn == info.subnqn
    assert back.max_transfer == 32 * 4096 and back.io_in_capsule_max == 8192


def test_identify_namespace_lba_formats() -> None:
    for lba, lbads in ((512, 9), (4096, 12)):
        raw = spec.NamespaceInfo(1, 1000, 1000, 1000, lba).encode()
        assert struct.unpack_from("<QQQ", raw, 0) == (1000, 1000, 1000)
        assert raw[25] == 0 and raw[26] == 0
        assert (struct.unpack_from("<I", raw, 128)[0] >> 16) & 0xFF == lbads
        back = spec.NamespaceInfo.decode(1, raw)
        assert back.lba_size == lba and back.size_bytes == 1000 * lba
    assert not spec.NamespaceInfo.decode(3, bytes(4096)).active


def test_ns_list_and_descriptors() -> None:
    raw = spec.encode_ns_list([5, 1, 3])
    assert spec.decode_ns_list(raw) == [1, 3, 5]
    desc = spec.encode_ns_descriptors(b"\x01" * 16, b"\x02" * 16)
    assert desc[:4] == bytes([2, 16, 0, 0]) and desc[20:24] == bytes([3, 16, 0, 0])


def test_discovery_log_round_trip() -> None:
    e = spec.DiscoveryEntry(trtype=3, adrfam=1, subtype=2, treq=4, portid=1, cntlid=0xFFFF,
                            asqsz=32, trsvcid="4420", subnqn="nqn.2026-01.io.kvtool:x",
                            traddr="127.0.0.1")
    raw = spec.encode_discovery_log(9, [e, e])
    assert len(raw) == 1024 + 2 * 1024
    assert spec.decode_discovery_header(raw) == (9, 2)
    entry = raw[1024:2048]
    assert entry[:4] == bytes([3, 1, 2, 4]) and struct.unpack_from("<HHH", entry, 4) == (1, 0xFFFF, 32)
    assert entry[32:36] == b"4420" and entry[512:521] == b"127.0.0.1"
    assert spec.DiscoveryEntry.decode(entry) == e


def test_status_field() -> None:
    assert spec.status(spec.SC_INVALID_FIELD) == (0x02 << 1) | 0x8000
    assert spec.status(0) == 0
    assert spec.status(spec.SC_CONNECT_INVALID_HOST, spec.SCT_COMMAND_SPECIFIC) == 0x8308
    assert "Invalid Host" in spec.status_name(1, 0x84)
    cap = spec.make_cap(mqes=127)
    assert spec.cap_mqes(cap) == 127 and spec.cap_timeout_s(cap) == 7.5 and cap >> 37 & 1
