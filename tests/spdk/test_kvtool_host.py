"""kvtool's userspace NVMe/TCP host → SPDK's nvmf_tgt (the production target).

One nvmf_tgt for the module (no hugepages, core 0): a subsystem with a 512 B malloc bdev
(NSID 1) and a 4 KiB-LBA AIO bdev on an O_DIRECT file (NSID 2), an allow list, a listener
on a free 127.0.0.1 port, and the discovery subsystem listening on the same port. Checks:
identify and discovery as kvtool reads them, writes read back with and without header and
data digests (the AIO file holds the bytes), DeepSeek-V4-Flash FP8 KV objects (1,002,240 B,
≡ 256 mod 512) loaded and verified through the bounce path, and corruption behind SPDK's back
found by verify.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtool.nvme.engine import open_nvme_tcp
from kvtool.nvme.host import ConnectError, connect, discover
from kvtool.target.spdk.app import SpdkApp
from kvtool.target.spdk.install import SpdkInstall
from tests.conftest import STORE_DIR, _odirect_ok, free_port, make_file, run, run_json

pytestmark = [pytest.mark.spdk, pytest.mark.integration, pytest.mark.slow]

NQN = "nqn.2016-06.io.spdk:kvtool-host"
HOSTNQN = "nqn.2026-01.io.kvtool:host:spdk"
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
MALLOC_BYTES = 64 << 20
AIO_BYTES = 32 << 20


@dataclass
class SpdkTarget:
    app: SpdkApp
    port: int
    aio_file: Path

    def url(self, nsid: int) -> str:
        return f"nvme+tcp://127.0.0.1:{self.port}/{NQN}/{nsid}?hostnqn={HOSTNQN}"


@pytest.fixture(scope="module")
def spdk_target(spdk: SpdkInstall) -> Iterator[SpdkTarget]:
    STORE_DIR.mkdir(parents=True, exist_ok=True)
    reason = _odirect_ok(STORE_DIR)
    if reason:
        pytest.skip(reason)
    workdir = STORE_DIR / f"spdk-{uuid.uuid4().hex[:8]}"
    workdir.mkdir()
    aio_file = make_file(workdir, AIO_BYTES, "aio.img")
    app = SpdkApp(spdk, die_with_parent=True).start()
    try:
        port = free_port()
        app.rpc("nvmf_create_transport", {"trtype": "TCP"})
        app.rpc("bdev_malloc_create", {"name": "Mal0", "num_blocks": MALLOC_BYTES // 512,
                                       "block_size": 512})
        app.rpc("bdev_aio_create", {"name": "Aio0", "filename": str(aio_file),
                                    "block_size": 4096})
        app.rpc("nvmf_create_subsystem", {"nqn": NQN, "serial_number": "KVT0001"})
        for nsid, bdev in ((1, "Mal0"), (2, "Aio0")):
            app.rpc("nvmf_subsystem_add_ns", {"nqn": NQN, "namespace": {"bdev_name": bdev,
                                                                          "nsid": nsid}})
        app.rpc("nvmf_subsystem_add_host", {"nqn": NQN, "host": HOSTNQN})
        address = {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
                   "trsvcid": str(port)}
        for nqn in (NQN, DISCOVERY_NQN):
            app.rpc("nvmf_subsystem_add_listener", {"nqn": nqn, "listen_address": address})
        yield SpdkTarget(app, port, aio_file)
    finally:
        app.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_identify(spdk_target: SpdkTarget) -> None:
    with connect("127.0.0.1", spdk_target.port, NQN, hostnqn=HOSTNQN) as ctrl:
        info = ctrl.identify_controller()
        assert info.mn.strip() == "SPDK bdev Controller"
        assert info.sn.strip() == "KVT0001" and info.subnqn == NQN
        assert ctrl.active_namespaces() == [1, 2]
        ns1, ns2 = ctrl.identify_namespace(1), ctrl.identify_namespace(2)
        assert (ns1.lba_size, ns1.size_bytes) == (512, MALLOC_BYTES)
        assert (ns2.lba_size, ns2.size_bytes) == (4096, AIO_BYTES)


def test_discovery(spdk_target: SpdkTarget) -> None:
    entries = discover("127.0.0.1", spdk_target.port, hostnqn=HOSTNQN)
    nvm = [e for e in entries if e.subtype == 2]
    assert [(e.subnqn, e.trtype, e.adrfam, e.traddr, e.trsvcid) for e in nvm] == [
        (NQN, 3, 1, "127.0.0.1", str(spdk_target.port))]


def test_host_not_on_the_allow_list_is_refused(spdk_target: SpdkTarget) -> None:
    with pytest.raises(ConnectError):
        connect("127.0.0.1", spdk_target.port, NQN, hostnqn="nqn.2026-01.io.kvtool:stranger")


@pytest.mark.parametrize(("hdgst", "ddgst"), [(False, False), (True, True), (True, False)],
                         ids=["no-digest", "hdgst+ddgst", "hdgst"])
def test_writes_read_back_and_land_in_the_aio_file(spdk_target: SpdkTarget, hdgst: bool,
                                                   ddgst: bool) -> None:
    """In-capsule (4 KiB) and R2T (3 MiB) writes, read back by C2HData, with the digests
    negotiated (the host refuses an ICResp that does not mirror them)."""
    base = {(False, False): 0, (True, True): 8 << 20, (True, False): 16 << 20}[(hdgst, ddgst)]
    small, large = os.urandom(4096), os.urandom(3 << 20)
    with connect("127.0.0.1", spdk_target.port, NQN, hostnqn=HOSTNQN, io_queues=2,
                 header_digest=hdgst, data_digest=ddgst) as ctrl:
        for nsid, lba in ((1, 512), (2, 4096)):
            ctrl.write(nsid, base // lba, small)
            ctrl.write(nsid, (base + (1 << 20)) // lba, large)
            ctrl.flush(nsid)
            assert ctrl.read(nsid, base // lba, len(small) // lba) == small
            assert ctrl.read(nsid, (base + (1 << 20)) // lba, len(large) // lba) == large
    with open(spdk_target.aio_file, "rb") as f:
        f.seek(base)
        assert f.read(len(small)) == small
        f.seek(base + (1 << 20))
        assert hashlib.sha256(f.read(len(large))).digest() == hashlib.sha256(large).digest()


def test_engine_qd32_with_digests(spdk_target: SpdkTarget) -> None:
    """The store engine, 32 commands in flight over 2 queues, with both digests."""
    extents = [(24 << 20) + i * 65536 for i in range(64)]
    payloads = [os.urandom(65536) for _ in extents]
    with open_nvme_tcp(spdk_target.url(1), write=True, qd=32, header_digest=True,
                       data_digest=True) as eng:
        for fut in [eng.submit_write(off, memoryview(data))
                    for off, data in zip(extents, payloads, strict=True)]:
            fut.result(timeout=60)
        bufs = [bytearray(65536) for _ in extents]
        for fut in [eng.submit_read(off, memoryview(buf))
                    for off, buf in zip(extents, bufs, strict=True)]:
            fut.result(timeout=60)
    assert [bytes(b) for b in bufs] == payloads


@pytest.mark.parametrize(("nsid", "slot_bytes"), [(1, 1_002_496), (2, 1_003_520)],
                         ids=["512B-malloc", "4KiB-aio"])
def test_load_and_verify_deepseek_objects_bounce_path(spdk_target: SpdkTarget, nsid: int,
                                                      slot_bytes: int) -> None:
    url = spdk_target.url(nsid)
    count = 12
    loaded = run_json("load", url, "--model", "deepseek-v4-flash", "--dtype", "fp8",
                      "--count", str(count), "--seed", "3", "--qd", "8", "--force")
    assert (loaded["written"], loaded["io_path"]) == (count, "bounce")
    assert loaded["store"]["slot_bytes"] == slot_bytes
    verified = run_json("verify", url)
    assert (verified["ok"], verified["objects_checked"], verified["bad"]) == (True, count, [])
    if nsid != 2:
        return
    # zero 4 KiB inside slot 0's object in the AIO bdev's file, behind SPDK's back
    offset = loaded["store"]["data_offset"] + 8192
    with open(spdk_target.aio_file, "r+b") as f:
        f.seek(offset)
        f.write(bytes(4096))
        f.flush()
        os.fsync(f.fileno())
    result = run("--json", "verify", url)
    assert result.exit_code == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert {bad["slot"] for bad in report["bad"]} == {0}
