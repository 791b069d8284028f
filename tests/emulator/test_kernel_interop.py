"""Interop with the real Linux kernel, both directions (issue 5), in one QEMU guest.

(a) kvtool's userspace NVMe/TCP host  ->  the guest kernel's nvmet-tcp target
    (hostfwd 127.0.0.1:PORT -> guest :4420): identify, discovery, write/read back with the
    bytes checked in the kernel's backing store (/dev/ram0), and 1,002,240-byte KV objects
    through kvtool's bounce path.
(b) the guest kernel's nvme-tcp host  ->  kvtool's target on the host (python -m
    emulator.nvmetcp), the guest restricted to one explicit forward (10.0.2.100:PORT):
    nvme connect, dd with O_DIRECT, read back, checksums equal to the target's backing file.
Both with and without header/data digests. A recording TCP tap between the peers proves
what was negotiated on the wire (the ICReq/ICResp DGST bits), so a digest test cannot pass
with digests silently off. One guest boots for the whole module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from emulator.qemu.guest import GUESTFWD_ADDR, Guest
from kvtool.nvme.engine import open_nvme_tcp
from kvtool.nvme.host import ConnectError, connect, discover
from tests.conftest import run, run_json
from tests.helpers.guest_nvme import dmesg_tail, guest_sha256, kernel_connect, kernel_disconnect
from tests.helpers.qemu_guest import GUEST_HOSTNQN, KernelTarget

pytestmark = [pytest.mark.qemu, pytest.mark.integration, pytest.mark.slow]

KVTOOL_NQN = "nqn.2026-01.io.kvtool:interop"
KVTOOL_HOSTNQN = "nqn.2026-01.io.kvtool:host:interop"
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
BACKING_BYTES = 64 << 20
OBJECT_BYTES = 1_002_240  # DeepSeek-V4-Flash FP8, 256-token block: ≡ 256 (mod 512)
DIGESTS = [pytest.param(False, False, id="no-digest"),
           pytest.param(True, True, id="hdgst+ddgst")]


# --- a recording TCP tap ------------------------------------------------------------------------


@dataclass
class Flow:
    """First bytes each way of one proxied connection (enough for ICReq and ICResp)."""

    to_server: bytearray = field(default_factory=bytearray)
    to_client: bytearray = field(default_factory=bytearray)

    def icreq_dgst(self) -> int:
        assert self.to_server[0] == 0x00 and len(self.to_server) >= 128, bytes(self.to_server[:8])
        return self.to_server[11]

    def icresp_dgst(self) -> int:
        assert self.to_client[0] == 0x01 and len(self.to_client) >= 128, bytes(self.to_client[:8])
        return self.to_client[11]

    def controller_pdus(self) -> list[tuple[int, int]]:
        """(PDU type, flags) of every complete PDU the controller sent (common header walk)."""
        out = []
        stream, off = bytes(self.to_client), 0
        while off + 8 <= len(stream):
            ptype, flags, _hlen, _pdo, plen = struct.unpack_from("<BBBBI", stream, off)
            if plen < 8 or off + plen > len(stream):
                break
            out.append((ptype, flags))
            off += plen
        return out


class Tap:
    """A 127.0.0.1 TCP proxy to ``upstream_port`` recording each connection's first ``keep``
    bytes each way."""

    def __init__(self, upstream_port: int, keep: int = 256) -> None:
        self.upstream_port = upstream_port
        self.keep = keep
        self.flows: list[Flow] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._srv.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            flow = Flow()
            self.flows.append(flow)
            threading.Thread(target=self._pump_pair, args=(client, flow), daemon=True).start()

    def _pump_pair(self, client: socket.socket, flow: Flow) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, (server, flow.to_server))
        sel.register(server, selectors.EVENT_READ, (client, flow.to_client))
        try:
            while len(sel.get_map()):
                for key, _ in sel.select():
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    dst, record = key.data
                    data = src.recv(1 << 20)
                    if not data:
                        sel.unregister(src)
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)
                        continue
                    if len(record) < self.keep:
                        record += data[: self.keep - len(record)]
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        self._stop = True
        self._srv.close()


# --- kvtool's target on the host, reachable from the guest ---------------------------------------


@dataclass
class UserspaceTarget:
    port: int
    nqn: str
    backing: Path
    proc: subprocess.Popen[str]
    tap: Tap

    def stored(self, offset: int, length: int) -> bytes:
        with self.backing.open("rb") as f:
            f.seek(offset)
            return f.read(length)


@pytest.fixture(scope="module")
def kvtool_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UserspaceTarget]:
    backing = tmp_path_factory.mktemp("interop") / "ns1.img"
    with backing.open("wb") as f:
        f.truncate(BACKING_BYTES)
    stderr = (backing.parent / "target.stderr").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "emulator.nvmetcp", "--listen", "127.0.0.1:0", "--nqn", KVTOOL_NQN,
         "--backing", str(backing), "--host", GUEST_HOSTNQN, "--host", KVTOOL_HOSTNQN],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=30):
        proc.kill()
        pytest.fail("kvtool target printed no ready line within 30 s")
    line = proc.stdout.readline()
    assert line.startswith("ready nvme+tcp://127.0.0.1:"), (
        line + (backing.parent / "target.stderr").read_text())
    port = int(line.split()[1].split("/")[2].rsplit(":", 1)[1])
    tap = Tap(port)
    try:
        yield UserspaceTarget(port, KVTOOL_NQN, backing, proc, tap)
    finally:
        tap.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr.close()


@pytest.fixture(scope="module")
def kernel_target_options(kvtool_target: UserspaceTarget) -> dict[str, Any]:
    """The module's one guest may reach exactly one host port: the tap to kvtool's target."""
    return {"guest_forwards": [kvtool_target.tap.port]}


# --- guest-side helpers ------------------------------------------------------------------------


def dmesg_mark(guest: Guest) -> int:
    return int(guest.check("dmesg | wc -l"))


def dmesg_since(guest: Guest, mark: int) -> str:
    """Kernel messages logged after ``dmesg_mark`` returned ``mark``."""
    return guest.check(f"dmesg | tail -n +{mark + 1}")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def assert_negotiated(flows: list[Flow], digests: bool) -> None:
    """Every connection asked for and got exactly the digests wanted (ICReq/ICResp DGST)."""
    want = 0b11 if digests else 0
    assert flows, "no NVMe/TCP connection went through the tap"
    for flow in flows:
        assert (flow.icreq_dgst(), flow.icresp_dgst()) == (want, want)


# --- (b) the guest kernel's host -> kvtool's target ----------------------------------------------


@pytest.mark.parametrize(("hdgst", "ddgst"), DIGESTS)
def test_kernel_host_dd_o_direct_to_kvtool_target(
    kernel_target: KernelTarget, kvtool_target: UserspaceTarget, hdgst: bool, ddgst: bool
) -> None:
    guest, tap = kernel_target.guest, kvtool_target.tap
    digests = hdgst and ddgst
    first_flow = len(tap.flows)
    base = (32 if digests else 8) << 20  # each parametrization writes its own region
    length = 4 << 20
    small = [base + length + 4096 * (3 * k + 1) for k in range(4)]  # in-capsule-sized writes
    dev = kernel_connect(guest, tap.port, kvtool_target.nqn, digests=digests)
    try:
        assert int(guest.check(f"blockdev --getsize64 {dev}")) == BACKING_BYTES
        # the kernel parsed kvtool's Identify Controller and honours its MDTS (2^8 × 4 KiB)
        ident = guest.check(f"nvme id-ctrl {dev[:-2]}")
        assert "mn        : kvtool emulator" in ident and "mdts      : 8\n" in ident, ident
        block = dev.removeprefix("/dev/")
        assert guest.check(f"cat /sys/block/{block}/queue/max_hw_sectors_kb").strip() == "1024"
        guest.check(f"head -c {length} /dev/urandom >/tmp/big; head -c {4096 * len(small)}"
                    " /dev/urandom >/tmp/small")
        big_sha = guest.check("sha256sum </tmp/big").split()[0]
        guest.check(f"dd if=/tmp/big of={dev} bs=1M seek={base >> 20} oflag=direct conv=fsync",
                    timeout=120)
        for k, off in enumerate(small):
            guest.check(f"dd if=/tmp/small of={dev} bs=4096 skip={k} seek={off // 4096} count=1"
                        " oflag=direct conv=fsync")
        small_shas = [guest.check(f"dd if=/tmp/small bs=4096 skip={k} count=1 2>/dev/null"
                                  " | sha256sum").split()[0] for k in range(len(small))]
        readback = guest_sha256(guest, dev, base, length)
        small_readback = [guest_sha256(guest, dev, off, 4096) for off in small]
    except Exception:
        print(dmesg_tail(guest))
        raise
    finally:
        kernel_disconnect(guest, kvtool_target.nqn)
    assert readback == big_sha
    assert small_readback == small_shas
    # what kvtool's target stored is exactly what the kernel wrote
    assert sha256(kvtool_target.stored(base, length)) == big_sha
    assert [sha256(kvtool_target.stored(off, 4096)) for off in small] == small_shas
    flows = tap.flows[first_flow:]
    assert len(flows) >= 2  # the admin queue and at least one I/O queue
    assert_negotiated(flows, digests)


def test_kernel_host_discovers_kvtool_target(
    kernel_target: KernelTarget, kvtool_target: UserspaceTarget
) -> None:
    guest, tap = kernel_target.guest, kvtool_target.tap
    out = guest.check(f"nvme discover -t tcp -a {GUESTFWD_ADDR} -s {tap.port}", timeout=60)
    assert f"subnqn:  {kvtool_target.nqn}" in out, out
    assert "trtype:  tcp" in out, out


def test_kernel_host_with_unlisted_hostnqn_is_refused(
    kernel_target: KernelTarget, kvtool_target: UserspaceTarget
) -> None:
    guest, tap = kernel_target.guest, kvtool_target.tap
    mark = dmesg_mark(guest)
    rc, out = guest.exec(f"nvme connect -t tcp -a {GUESTFWD_ADDR} -s {tap.port}"
                         f" -n {kvtool_target.nqn} -q nqn.2026-01.io.kvtool:host:stranger")
    assert rc != 0, out
    assert "nqn.2026-01.io.kvtool:host:stranger" not in guest.check(
        "cat /sys/class/nvme/*/hostnqn 2>/dev/null || true")
    # the kernel got Connect status 0x4184: DNR | SCT 1 / SC 0x84 (Connect Invalid Host)
    log = dmesg_since(guest, mark)
    assert "is not allowed, hostnqn: nqn.2026-01.io.kvtool:host:stranger" in log, log
    assert f"ret={0x4184}" in log, log


# --- (a) kvtool's host -> the guest kernel's nvmet-tcp target ------------------------------------


def test_kvtool_host_identifies_kernel_target(kernel_target: KernelTarget) -> None:
    with connect(kernel_target.host, kernel_target.port, kernel_target.subnqn,
                 hostnqn=KVTOOL_HOSTNQN) as ctrl:
        info = ctrl.identify_controller()
        assert info.mn.strip() == "Linux"
        assert kernel_target.guest.image is not None
        # FR is the first 8 characters of the release, e.g. "6.1.0-56" of "6.1.0-56-amd64"
        assert kernel_target.guest.image.kernel_version.startswith(info.fr.strip())
        assert info.subnqn == kernel_target.subnqn
        assert info.cntrltype == 1  # I/O controller
        assert info.icdoff == 0 and info.sqes == 0x66 and info.cqes == 0x44
        assert ctrl.active_namespaces() == [kernel_target.nsid]
        ns = ctrl.identify_namespace(kernel_target.nsid)
        assert (ns.lba_size, ns.size_bytes) == (kernel_target.lba_size, kernel_target.size)
        assert not ctrl.identify_namespace(kernel_target.nsid + 1).active


def test_kvtool_host_reads_kernel_discovery_log(kernel_target: KernelTarget) -> None:
    entries = discover(kernel_target.host, kernel_target.port, hostnqn=KVTOOL_HOSTNQN)
    nvm = [e for e in entries if e.subtype == 2]
    assert [e.subnqn for e in nvm] == [kernel_target.subnqn]
    entry = nvm[0]
    assert (entry.trtype, entry.adrfam, entry.trsvcid) == (3, 1, "4420")  # TCP, IPv4
    # the port listens on 0.0.0.0: the kernel reports the address the host reached it at
    assert entry.traddr == "10.0.2.15"


C2H_DATA, DATA_SUCCESS = 0x07, 0x08


@pytest.mark.parametrize(("hdgst", "ddgst", "sqflow_off", "base_mib"), [
    pytest.param(False, False, False, 40, id="no-digest"),
    pytest.param(True, True, False, 44, id="hdgst+ddgst"),
    pytest.param(True, True, True, 48, id="hdgst+ddgst+sqflow-off"),
])
def test_kvtool_host_writes_reach_the_kernel_backing_store(
    kernel_target: KernelTarget, hdgst: bool, ddgst: bool, sqflow_off: bool, base_mib: int
) -> None:
    """Writes in-capsule and by R2T, reads by C2HData; with SQ flow control disabled the
    kernel completes reads with C2HData SUCCESS and no CapsuleResp, which kvtool must accept."""
    guest, lba = kernel_target.guest, kernel_target.lba_size
    mark = dmesg_mark(guest)
    tap = Tap(kernel_target.port, keep=16 << 20)
    base = base_mib << 20  # 40..52 MiB: above the KV store of the load/verify test
    small = os.urandom(4096)  # fits in-capsule (the kernel advertises 16 KiB)
    large = os.urandom(3 << 20)  # R2T + H2CData, several commands
    try:
        with connect("127.0.0.1", tap.port, kernel_target.subnqn, hostnqn=KVTOOL_HOSTNQN,
                     io_queues=2, header_digest=hdgst, data_digest=ddgst,
                     disable_sqflow=sqflow_off) as ctrl:
            ctrl.write(kernel_target.nsid, base // lba, small)
            ctrl.write(kernel_target.nsid, (base + (1 << 20)) // lba, large)
            ctrl.flush(kernel_target.nsid)
            assert ctrl.read(kernel_target.nsid, base // lba, len(small) // lba) == small
            assert ctrl.read(kernel_target.nsid, (base + (1 << 20)) // lba,
                             len(large) // lba) == large
    except Exception:
        print(dmesg_tail(guest))
        raise
    finally:
        tap.close()
    # the bytes sit in the kernel target's backing store, /dev/ram0
    assert guest_sha256(guest, "/dev/ram0", base, 4096) == sha256(small)
    assert guest_sha256(guest, "/dev/ram0", base + (1 << 20), len(large)) == sha256(large)
    assert len(tap.flows) == 3  # admin + 2 I/O queues
    assert_negotiated(tap.flows, hdgst and ddgst)
    assert "digest" not in dmesg_since(guest, mark).lower()
    c2h = [flags for flow in tap.flows[1:] for ptype, flags in flow.controller_pdus()
           if ptype == C2H_DATA]
    assert len(c2h) >= 4  # the 4 KiB read, and the 3 MiB read in 1 MiB commands
    assert all(bool(flags & DATA_SUCCESS) == sqflow_off for flags in c2h)


def test_kvtool_load_and_verify_bounce_objects_on_kernel_target(
    kernel_target: KernelTarget,
) -> None:
    """1,002,240-byte objects (≡ 256 mod 512) take the bounce path onto the kernel's namespace."""
    url = kernel_target.url
    count = 16
    loaded = run_json("load", url, "--object-bytes", str(OBJECT_BYTES), "--count", str(count),
                      "--seed", "5", "--qd", "8")
    assert (loaded["written"], loaded["io_path"]) == (count, "bounce")
    assert loaded["store"]["slot_bytes"] == 1_002_496  # 1,958 blocks of 512 B
    assert loaded["engine"]["lba_size"] == kernel_target.lba_size
    verified = run_json("verify", url)
    assert (verified["ok"], verified["objects_checked"], verified["bad"]) == (True, count, [])

    # zero one 512-byte block inside slot 0's object, behind the target's back, in /dev/ram0
    guest = kernel_target.guest
    block = (loaded["store"]["data_offset"] + 4096) // 512
    before = guest.check(f"dd if=/dev/ram0 bs=512 skip={block} count=1 iflag=direct 2>/dev/null"
                         " | sha256sum")
    guest.check(f"dd if=/dev/zero of=/dev/ram0 bs=512 seek={block} count=1 oflag=direct")
    assert guest.check(f"dd if=/dev/ram0 bs=512 skip={block} count=1 iflag=direct 2>/dev/null"
                       " | sha256sum") != before
    result = run("--json", "verify", url)
    assert result.exit_code == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert {(bad["slot"], bad["offset"]) for bad in report["bad"]} == {
        (0, loaded["store"]["data_offset"])}, report["bad"]


def test_kvtool_engine_many_commands_in_flight_on_kernel_target(
    kernel_target: KernelTarget,
) -> None:
    """QD 32 over 2 I/O queues, mixed sizes (in-capsule and R2T), read back and compared."""
    rng = random.Random(7)
    lba = kernel_target.lba_size
    region = 56 << 20  # 56..64 MiB: nobody else's
    extents = []
    cursor = region
    while cursor < region + (8 << 20):
        length = rng.choice([512, 4096, 12288, 65536, 262144])
        if cursor + length > region + (8 << 20):
            break
        extents.append((cursor, os.urandom(length)))
        cursor += length + rng.choice([0, 512, 4096])
    rng.shuffle(extents)
    with open_nvme_tcp(kernel_target.url, write=True, qd=32, hostnqn=KVTOOL_HOSTNQN) as eng:
        assert len(eng.ctrl.io) == 2
        for fut in [eng.submit_write(off, memoryview(data)) for off, data in extents]:
            fut.result(timeout=60)
        eng.flush()
        bufs = [(data, bytearray(len(data))) for _, data in extents]
        futs = [eng.submit_read(off, memoryview(buf))
                for (off, _), (_, buf) in zip(extents, bufs, strict=True)]
        for fut in futs:
            fut.result(timeout=60)
    assert all(bytes(buf) == data for data, buf in bufs)
    assert lba == 512 and len(extents) > 40


def _add_guest_subsystem(guest: Guest, nqn: str, *, hosts: list[str], size_mb: int) -> None:
    """A second subsystem on the guest's live port 1, file-backed, with an allow list."""
    t = "/sys/kernel/config/nvmet"
    links = " ".join(f"mkdir -p {t}/hosts/{h} && ln -s {t}/hosts/{h} $S/allowed_hosts/{h} &&"
                     for h in hosts)
    guest.check(f"S={t}/subsystems/{nqn} && mkdir $S && {links}"
                f" truncate -s {size_mb}M /tmp/{nqn}.img && mkdir $S/namespaces/1 &&"
                f" echo -n /tmp/{nqn}.img >$S/namespaces/1/device_path &&"
                f" echo 1 >$S/namespaces/1/buffered_io && echo 1 >$S/namespaces/1/enable &&"
                f" ln -s $S {t}/ports/1/subsystems/{nqn}")


def test_kernel_target_allow_list_and_4k_lba_namespace_with_kvtool_host(
    kernel_target: KernelTarget,
) -> None:
    """A file-backed kernel namespace has 4 KiB LBAs: objects pad to 1,003,520 B; the kernel
    refuses a host NQN that is not on the subsystem's allow list and kvtool says so."""
    nqn = "nqn.2026-01.io.kvtool:guarded"
    _add_guest_subsystem(kernel_target.guest, nqn, hosts=[KVTOOL_HOSTNQN], size_mb=32)
    with pytest.raises(ConnectError, match="is not allowed") as refused:
        connect(kernel_target.host, kernel_target.port, nqn,
                hostnqn="nqn.2026-01.io.kvtool:host:stranger")
    assert (refused.value.sct, refused.value.sc, refused.value.dnr) == (1, 0x84, True)

    url = f"nvme+tcp://{kernel_target.host}:{kernel_target.port}/{nqn}/1?hostnqn={KVTOOL_HOSTNQN}"
    with connect(kernel_target.host, kernel_target.port, nqn, hostnqn=KVTOOL_HOSTNQN) as ctrl:
        assert ctrl.identify_namespace(1).lba_size == 4096
    loaded = run_json("load", url, "--object-bytes", str(OBJECT_BYTES), "--count", "6")
    assert loaded["store"]["slot_bytes"] == 1_003_520  # 245 blocks of 4 KiB
    assert (loaded["written"], loaded["io_path"]) == (6, "bounce")
    verified = run_json("verify", url)
    assert (verified["ok"], verified["objects_checked"]) == (True, 6)


def test_keep_alive_both_directions_across_an_idle_period(
    kernel_target: KernelTarget, kvtool_target: UserspaceTarget
) -> None:
    """Both peers stay connected while idle longer than KATO: each side's Keep Alive is
    accepted by the other (the kernel host's default KATO is 5 s, kvtool's 10 s)."""
    guest, tap = kernel_target.guest, kvtool_target.tap
    mark = dmesg_mark(guest)
    dev = kernel_connect(guest, tap.port, kvtool_target.nqn, digests=False)
    try:
        with connect(kernel_target.host, kernel_target.port, kernel_target.subnqn,
                     hostnqn=KVTOOL_HOSTNQN, kato_ms=4000) as ctrl:
            time.sleep(12)
            assert ctrl.read(kernel_target.nsid, 0, 8)  # still the same controller
            assert ctrl.reconnects == 0
        guest.check(f"dd if={dev} of=/dev/null bs=4096 count=1 iflag=direct")
        log = dmesg_since(guest, mark)
        assert "keep-alive" not in log.lower() and "reconnect" not in log.lower(), log
        kernel_ctrl = guest.check("for c in /sys/class/nvme/nvme*; do"
                                  f" [ \"$(cat $c/subsysnqn)\" = {kvtool_target.nqn} ] &&"
                                  " cat $c/state; done")
        assert kernel_ctrl.strip() == "live"
    finally:
        kernel_disconnect(guest, kvtool_target.nqn)
