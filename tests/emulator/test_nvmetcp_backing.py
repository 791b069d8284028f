"""Namespace backings: memory, a regular file, and a real block device (loop device)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from emulator.nvmetcp import Target, simple_config
from emulator.nvmetcp.backing import FileBacking, MemoryBacking, open_backing
from kvtool.errors import InputError
from kvtool.nvme import host

NQN = "nqn.2026-01.io.kvtool:backing"
HOSTNQN = "nqn.2026-01.io.kvtool:backing-host"


def test_open_backing_kinds(tmp_path: Path) -> None:
    mem = open_backing("2MiB")
    assert isinstance(mem, MemoryBacking) and mem.size == 2 << 20
    mem.write(4096, b"abc")
    assert mem.read(4095, 5) == b"\0abc\0"
    mem.close()
    f = open_backing(str(tmp_path / "new.img"), size="1MiB")
    assert isinstance(f, FileBacking) and f.kind == "file" and f.size == 1 << 20
    f.write(512, b"xyz")
    f.flush()
    f.close()
    assert (tmp_path / "new.img").read_bytes()[512:515] == b"xyz"
    with pytest.raises(InputError, match="neither an existing file"):
        open_backing(str(tmp_path / "missing.img"))
    with pytest.raises(InputError, match="Is a directory"):
        open_backing(str(tmp_path))


@pytest.mark.integration
@pytest.mark.root
def test_block_device_namespace(loop_device: Callable[..., str]) -> None:
    dev = loop_device(8 << 20, 512)
    target = Target(simple_config(nqn=NQN, backing=dev, hosts=[HOSTNQN],
                                  listen=["127.0.0.1:0"])).start_in_thread()
    try:
        ns = target.subsystems[NQN].namespaces[1]
        assert ns.backing.kind == "block" and ns.backing.size == 8 << 20
        data = os.urandom(256 * 1024)
        with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOSTNQN) as ctrl:
            assert ctrl.identify_namespace(1).size_bytes == 8 << 20
            ctrl.write(1, 2048, data)
            ctrl.flush(1)
            assert ctrl.read(1, 2048, len(data) // 512) == data
    finally:
        target.stop()
    with open(dev, "rb") as fh:  # the bytes are on the device itself
        fh.seek(2048 * 512)
        assert fh.read(len(data)) == data


def test_force_unit_access_completes_only_once_durable(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The target reports a volatile write cache, so a Write or Write Zeroes with FUA
    completes only after the backing is flushed: a flush that fails fails the command,
    and without FUA no flush runs (in-capsule data and data after an R2T alike)."""
    from emulator.nvmetcp.conformance.host import Session, rw
    from emulator.nvmetcp.conformance.host import Target as Peer
    from kvtool.nvme import spec

    flushes: list[str] = []
    fail = {"on": False}
    real_flush = FileBacking.flush

    def flush(self: FileBacking) -> None:
        flushes.append("fail" if fail["on"] else "ok")
        if fail["on"]:
            raise OSError(5, "injected: the medium did not take the data")
        real_flush(self)

    monkeypatch.setattr(FileBacking, "flush", flush)
    img = tmp_path / "ns.img"
    target = Target(simple_config(nqn=NQN, backing=str(img), size="4MiB", allow_any_host=True,
                                  listen=["127.0.0.1:0"])).start_in_thread()
    fua = 1 << 30
    small, large = os.urandom(512), os.urandom(128 * 1024)  # in-capsule; after an R2T
    try:
        with Session(Peer("127.0.0.1", target.port, NQN), io=True) as s:
            assert s.io is not None
            for data, slba in ((small, 8), (large, 64)):
                nlb = len(data) // 512
                assert rw(s.io, spec.IO_WRITE, slba, nlb, data=data).cqe.ok
                assert flushes == []
                assert rw(s.io, spec.IO_WRITE, slba, nlb, data=data, cdw12_extra=fua).cqe.ok
                assert flushes == ["ok"]
                fail["on"] = True
                failed = rw(s.io, spec.IO_WRITE, slba, nlb, data=data, cdw12_extra=fua)
                assert not failed.cqe.ok and flushes == ["ok", "fail"]
                assert rw(s.io, spec.IO_WRITE, slba, nlb, data=data).cqe.ok  # no FUA, no flush
                fail["on"] = False
                flushes.clear()
            assert rw(s.io, spec.IO_WRITE_ZEROES, 8, 1).cqe.ok and flushes == []
            assert rw(s.io, spec.IO_WRITE_ZEROES, 8, 1, cdw12_extra=fua).cqe.ok
            fail["on"] = True
            assert not rw(s.io, spec.IO_WRITE_ZEROES, 8, 1, cdw12_extra=fua).cqe.ok
            assert flushes == ["ok", "fail"]
            fail["on"] = False
    finally:
        target.stop()
    with open(img, "rb") as fh:
        fh.seek(64 * 512)
        assert fh.read(len(large)) == large
