"""kvtool host ↔ kvtool target over real TCP sockets on 127.0.0.1."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest

from emulator.nvmetcp import Target
from kvtool.nvme import host, spec
from kvtool.nvme import pdu as P
from kvtool.nvme.queue import NvmeStatusError, TransportError
from tests.nvme.conftest import HOST_A, HOST_B, HOST_C, NQN, NQN4K, STRANGER, make_config

pytestmark = pytest.mark.integration


def test_identify_and_namespaces(target: Target) -> None:
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A) as ctrl:
        info = ctrl.identify_controller()
        assert info.subnqn == NQN and info.mn == "kvtool emulator" and info.sn
        assert info.cntlid == ctrl.cntlid and info.mdts == 8 and info.max_transfer == 1 << 20
        assert info.cntrltype == 1 and info.icdoff == 0 and info.sgls & 1
        assert info.io_in_capsule_max == 8192
        assert ctrl.active_namespaces() == [1, 2]
        ns1, ns2 = ctrl.identify_namespace(1), ctrl.identify_namespace(2)
        assert (ns1.nsze, ns1.lba_size, ns1.size_bytes) == (131072, 512, 64 << 20)
        assert ns2.size_bytes == 8 << 20
        assert not ctrl.identify_namespace(7).active  # inactive NSID: all zeros
    with host.connect("127.0.0.1", target.port, NQN4K, hostnqn=HOST_A) as ctrl:
        assert ctrl.identify_namespace(1).lba_size == 4096


@pytest.mark.parametrize(("hd", "dd", "poll"), [
    (False, False, False), (True, False, False), (False, True, False), (True, True, False),
    (False, False, True), (True, True, True)])
def test_read_write_paths(target: Target, hd: bool, dd: bool, poll: bool) -> None:
    """In-capsule (≤ 8 KiB), R2T with several H2CData PDUs, and split beyond MDTS; on
    interrupt-driven and on polled I/O queues."""
    rng = random.Random(hd * 2 + dd)
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_B, io_queues=2,
                      header_digest=hd, data_digest=dd, poll=poll) as ctrl:
        assert all(q.polled == poll for q in ctrl.io)
        small = rng.randbytes(4096)
        big = rng.randbytes(300 * 1024)  # > MAXH2CDATA (128 KiB): three H2CData PDUs
        huge = rng.randbytes(3 << 20)  # > MDTS (1 MiB): split into four commands
        ctrl.write(1, 10, small)
        ctrl.write(1, 1000, big)
        ctrl.write(1, 20000, huge)
        ctrl.flush(1)
        assert ctrl.read(1, 10, 8) == small
        assert ctrl.read(1, 1000, len(big) // 512) == big
        assert ctrl.read(1, 20000, len(huge) // 512) == huge
    with host.connect("127.0.0.1", target.port, NQN4K, hostnqn=HOST_A) as ctrl:
        ctrl.write(1, 3, big[:8192])
        assert ctrl.read(1, 3, 2) == big[:8192]
        with pytest.raises(ValueError):
            ctrl.write(1, 0, b"x" * 512)  # not a whole 4 KiB block


def test_c2h_success_without_capsule_resp(target: Target) -> None:
    """With SQ flow control disabled the target completes reads by C2HData SUCCESS."""
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_C,
                      disable_sqflow=True) as ctrl:
        data = os.urandom(64 * 1024)
        ctrl.write(2, 0, data)
        assert ctrl.read(2, 0, 128) == data


def test_lba_out_of_range_and_status(target: Target) -> None:
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A) as ctrl:
        q = ctrl.io[0]
        buf = bytearray(1024)
        cqe_err = None
        try:
            q.execute(P.Sqe(spec.IO_READ, nsid=2, cdw10=16383, cdw12=1), what="read",
                      data_in=memoryview(buf))
        except NvmeStatusError as exc:
            cqe_err = exc
        assert cqe_err is not None and cqe_err.sc == spec.SC_LBA_OUT_OF_RANGE and cqe_err.dnr
        with pytest.raises(NvmeStatusError) as info:  # inactive namespace
            q.execute(P.Sqe(spec.IO_READ, nsid=9, cdw12=0), what="read",
                      data_in=memoryview(buf)[:512])
        assert info.value.sc == spec.SC_INVALID_NS


def test_mdts_and_in_capsule_limits_enforced(target: Target) -> None:
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A) as ctrl:
        q = ctrl.io[0]
        buf = bytearray(2 << 20)  # 4096 blocks of 512: beyond MDTS (1 MiB)
        with pytest.raises(NvmeStatusError) as info:
            q.execute(P.Sqe(spec.IO_READ, nsid=1, cdw12=4095), what="read",
                      data_in=memoryview(buf))
        assert info.value.sc == spec.SC_INVALID_FIELD
        with pytest.raises(NvmeStatusError) as info:  # 16 KiB in-capsule > IOCCSZ limit
            q.execute(P.Sqe(spec.IO_WRITE, nsid=1, cdw12=31), what="write",
                      data_out=memoryview(bytes(16384)), in_capsule_max=1 << 20)
        assert info.value.sc == spec.SC_SGL_OFFSET_INVALID
        assert ctrl.read(1, 0, 1) is not None  # the queue is still healthy


def test_disallowed_host_is_refused(target: Target) -> None:
    with pytest.raises(host.ConnectError) as info:
        host.connect("127.0.0.1", target.port, NQN, hostnqn=STRANGER)
    assert info.value.sct == 1 and info.value.sc == spec.SC_CONNECT_INVALID_HOST
    assert "not allowed" in str(info.value) and STRANGER in str(info.value)
    with pytest.raises(host.ConnectError) as info:  # HOST_B is not on the 4K subsystem
        host.connect("127.0.0.1", target.port, NQN4K, hostnqn=HOST_B)
    assert info.value.sc == spec.SC_CONNECT_INVALID_HOST
    with pytest.raises(host.ConnectError, match="does not exist"):
        host.connect("127.0.0.1", target.port, "nqn.2026-01.io.kvtool:nope", hostnqn=HOST_A)


def test_discovery_log_is_filtered_per_host(target: Target) -> None:
    entries = host.discover("127.0.0.1", target.port, hostnqn=HOST_A)
    assert sorted(e.subnqn for e in entries) == sorted([NQN, NQN4K])
    e = entries[0]
    assert (e.trtype, e.adrfam, e.subtype, e.cntlid) == (3, 1, 2, 0xFFFF)
    assert (e.traddr, e.trsvcid, e.portid) == ("127.0.0.1", str(target.port), 1)
    assert [e.subnqn for e in host.discover("127.0.0.1", target.port, hostnqn=HOST_B)] == [NQN]
    assert host.discover("127.0.0.1", target.port, hostnqn=STRANGER) == []


@pytest.mark.parametrize("poll", [False, True])
def test_several_hosts_and_queues_concurrently(target: Target, poll: bool) -> None:
    """3 hosts × 3 I/O queues × pipelined writes and reads, each host its own LBA range."""
    errors: list[BaseException] = []
    chunk = 64 * 1024
    per_host = 48

    def worker(index: int, hostnqn: str) -> None:
        try:
            rng = random.Random(index)
            with host.connect("127.0.0.1", target.port, NQN, hostnqn=hostnqn, io_queues=3,
                              queue_depth=8, poll=poll) as ctrl:
                assert len(ctrl.io) == 3
                base = index * per_host * chunk // 512
                blobs = [rng.randbytes(chunk) for _ in range(per_host)]
                pending = []
                for i, blob in enumerate(blobs):
                    pending.append(ctrl.submit_io(spec.IO_WRITE, 1, base + i * chunk // 512,
                                                  memoryview(blob), 512))
                for q, cmd in pending:
                    q.wait(cmd)
                bufs = [bytearray(chunk) for _ in blobs]
                pending = [ctrl.submit_io(spec.IO_READ, 1, base + i * chunk // 512,
                                          memoryview(b), 512) for i, b in enumerate(bufs)]
                for q, cmd in pending:
                    q.wait(cmd)
                assert [bytes(b) for b in bufs] == blobs
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, h))
               for i, h in enumerate((HOST_A, HOST_B, HOST_C))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    # A fourth host reads every range back: the writes of all hosts landed.
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A) as ctrl:
        for index in range(3):
            rng = random.Random(index)
            first = rng.randbytes(chunk)
            assert ctrl.read(1, index * per_host * chunk // 512, chunk // 512) == first


def _recv_pdus(s: socket.socket, until: type) -> list[P.Pdu]:
    parser = P.PduParser(max_data=1 << 20)
    got: list[P.Pdu] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        chunk = s.recv(65536)
        if not chunk:
            break
        parser.feed(chunk)
        got.extend(parser)
        if any(isinstance(p, until) for p in got):
            break
    return got


def test_queue_depth_is_enforced(target: Target) -> None:
    """A host exceeding SQSIZE+1 outstanding commands gets a C2HTermReq and is cut off."""
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A, io_queues=0) as ctrl, \
            socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
        s.sendall(P.encode(P.ICReq()))
        assert isinstance(_recv_pdus(s, P.ICResp)[0], P.ICResp)
        data = spec.ConnectData(bytes(16), ctrl.cntlid, NQN, HOST_A).encode()
        connect = P.Sqe(spec.OPC_FABRICS, cid=1, nsid=spec.FCTYPE_CONNECT, cdw10=1 << 16,
                        cdw11=3, sgl=P.SglDescriptor.in_capsule(1024))  # SQSIZE 3: 4 entries
        s.sendall(P.encode(P.CapsuleCmd(connect, data)))
        resp = _recv_pdus(s, P.CapsuleResp)[0]
        assert isinstance(resp, P.CapsuleResp) and resp.cqe.ok
        # Writes with transport data stay outstanding until their R2T is answered: never.
        for i in range(5):
            sqe = P.Sqe(spec.IO_WRITE, cid=100 + i, nsid=1, cdw10=i, cdw12=0,
                        sgl=P.SglDescriptor.transport(512))
            s.sendall(P.encode(P.CapsuleCmd(sqe)))
        got = _recv_pdus(s, P.TermReq)
        assert [type(p).__name__ for p in got] == ["R2T"] * 4 + ["TermReq"]
        term = got[-1]
        assert isinstance(term, P.TermReq) and not term.h2c and term.fei == 10  # the CID
        assert s.recv(16) == b""
        assert ctrl.active_namespaces() == [1, 2]  # the admin queue is unaffected


def _raw_connect(s: socket.socket, cntlid: int = 0xFFFF, qid: int = 0) -> None:
    """ICReq and Connect on a raw socket (a new controller's admin queue by default)."""
    s.sendall(P.encode(P.ICReq()))
    assert isinstance(_recv_pdus(s, P.ICResp)[0], P.ICResp)
    data = spec.ConnectData(bytes(16), cntlid, NQN, HOST_A).encode()
    connect = P.Sqe(spec.OPC_FABRICS, cid=1, nsid=spec.FCTYPE_CONNECT, cdw10=qid << 16,
                    cdw11=31, sgl=P.SglDescriptor.in_capsule(1024))
    s.sendall(P.encode(P.CapsuleCmd(connect, data)))
    resp = _recv_pdus(s, P.CapsuleResp)[0]
    assert isinstance(resp, P.CapsuleResp) and resp.cqe.ok


def test_cid_of_an_abandoned_aer_may_be_reused(target: Target) -> None:
    """SPDK's host completes its own AERs when it detaches and reuses their CIDs for the
    shutdown's Property Set: the target answers it instead of cutting the queue off."""
    with socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
        _raw_connect(s)
        enable = P.Sqe(spec.OPC_FABRICS, cid=2, nsid=spec.FCTYPE_PROPERTY_SET,
                       cdw11=spec.PROP_CC, cdw12=spec.CC_DEFAULT_ENABLE)
        s.sendall(P.encode(P.CapsuleCmd(enable)))
        resp = _recv_pdus(s, P.CapsuleResp)[0]
        assert isinstance(resp, P.CapsuleResp) and resp.cqe.ok
        for cid in (3, 4):
            s.sendall(P.encode(P.CapsuleCmd(P.Sqe(spec.ADMIN_ASYNC_EVENT, cid=cid))))
        shutdown = P.Sqe(spec.OPC_FABRICS, cid=3, nsid=spec.FCTYPE_PROPERTY_SET,
                         cdw11=spec.PROP_CC,
                         cdw12=spec.CC_DEFAULT_ENABLE | spec.CC_SHN_NORMAL)
        s.sendall(P.encode(P.CapsuleCmd(shutdown)))
        got = _recv_pdus(s, P.CapsuleResp)
        assert [type(p).__name__ for p in got] == ["CapsuleResp"]
        resp = got[0]
        assert isinstance(resp, P.CapsuleResp) and resp.cqe.cid == 3 and resp.cqe.ok


def test_duplicate_cid_of_a_running_command_is_fatal(target: Target) -> None:
    """Reusing the CID of a write still waiting for its data: a C2HTermReq, FEI the CID."""
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A, io_queues=0) as ctrl, \
            socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
        _raw_connect(s, ctrl.cntlid, qid=1)
        for _ in range(2):
            sqe = P.Sqe(spec.IO_WRITE, cid=7, nsid=1, cdw12=0,
                        sgl=P.SglDescriptor.transport(512))
            s.sendall(P.encode(P.CapsuleCmd(sqe)))
        got = _recv_pdus(s, P.TermReq)
        assert [type(p).__name__ for p in got] == ["R2T", "TermReq"]
        term = got[-1]
        assert isinstance(term, P.TermReq) and term.fei == 10


def test_streamed_data_arriving_in_dribbles_completes(target: Target) -> None:
    """The target asks to be woken only for part of a streamed PDU's data (SO_RCVLOWAT):
    data that trickles in, then stops exactly at the PDU's end with nothing behind it,
    must still complete the write (waiting for bytes the host never owes would hang)."""
    payload = random.Random(5).randbytes(300 * 1024)
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A, io_queues=0) as ctrl, \
            socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
        _raw_connect(s, ctrl.cntlid, qid=1)
        sqe = P.Sqe(spec.IO_WRITE, cid=9, nsid=1, cdw10=3000, cdw12=len(payload) // 512 - 1,
                    sgl=P.SglDescriptor.transport(len(payload)))
        s.sendall(P.encode(P.CapsuleCmd(sqe)))
        r2t = _recv_pdus(s, P.R2T)[0]
        assert isinstance(r2t, P.R2T) and r2t.r2tl == len(payload)
        step = 128 * 1024  # MAXH2CDATA: three H2CData PDUs
        for off in range(0, len(payload), step):
            chunk = payload[off: off + step]
            pdu = P.encode(P.H2CData(9, r2t.ttag, off, chunk,
                                     last=off + step >= len(payload)))
            s.sendall(pdu[:24])
            for i in range(0, 20 * 997, 997):  # a trickle, then the rest at once
                s.sendall(pdu[24 + i: 24 + i + 997])
                time.sleep(0.001)
            s.sendall(pdu[24 + 20 * 997:])
        resp = _recv_pdus(s, P.CapsuleResp)[0]
        assert isinstance(resp, P.CapsuleResp) and resp.cqe.cid == 9 and resp.cqe.ok
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A) as ctrl:
        assert ctrl.read(1, 3000, len(payload) // 512) == payload


def _in_pingpong(sock: socket.socket) -> bool:
    """Linux reads TCP_QUICKACK back as 0 while the socket delays its ACKs ("pingpong")."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 0


@pytest.mark.parametrize("poll", [False, True], ids=["interrupt", "polled"])
def test_large_reads_ask_for_quick_acks(target: Target, poll: bool) -> None:
    """After request/response traffic Linux delays ACKs; a read larger than a segment
    turns that off, or the target's data waits for delayed ACKs (BENCHMARKS.md)."""
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A, poll=poll) as ctrl:
        q = ctrl.io[0]
        small = memoryview(bytearray(4096))
        for _ in range(5):
            q.wait(q.submit_rw(spec.IO_READ, 1, 0, 8, small))
        big = memoryview(bytearray(1 << 20))
        cmd = q.submit_rw(spec.IO_READ, 1, 0, len(big) // 512, big)
        assert not _in_pingpong(q.sock)
        q.wait(cmd)


def test_large_streamed_writes_get_quick_acks(target: Target) -> None:
    """The target's side of the same: once a large write's data streams in, it ACKs at
    once, so the host's send window keeps opening."""
    payload = random.Random(6).randbytes(128 * 1024)
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A, io_queues=0) as ctrl, \
            socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
        _raw_connect(s, ctrl.cntlid, qid=1)
        mine = [c for c in target.state.connections if c.local is not None
                and c.peer == "{}:{}".format(*s.getsockname())]
        assert len(mine) == 1 and mine[0].transport is not None
        theirs = mine[0].transport.get_extra_info("socket")
        for cid in range(5):  # request/response: the target's socket delays its ACKs
            sqe = P.Sqe(spec.IO_READ, cid=cid, nsid=1, cdw12=0,
                        sgl=P.SglDescriptor.transport(512))
            s.sendall(P.encode(P.CapsuleCmd(sqe)))
            _recv_pdus(s, P.CapsuleResp)
        sqe = P.Sqe(spec.IO_WRITE, cid=9, nsid=1, cdw10=5000, cdw12=len(payload) // 512 - 1,
                    sgl=P.SglDescriptor.transport(len(payload)))
        s.sendall(P.encode(P.CapsuleCmd(sqe)))
        r2t = _recv_pdus(s, P.R2T)[0]
        assert isinstance(r2t, P.R2T)
        pdu = P.encode(P.H2CData(9, r2t.ttag, 0, payload, last=True))
        s.sendall(pdu[:24 + 4096])  # the target now streams the rest into place
        deadline = time.monotonic() + 5
        while not mine[0].streaming and time.monotonic() < deadline:
            time.sleep(0.0005)
        # at once: Linux's delayed-ACK timer (40 ms) would end pingpong mode by itself
        assert mine[0].streaming and not _in_pingpong(theirs)
        s.sendall(pdu[24 + 4096:])
        resp = _recv_pdus(s, P.CapsuleResp)[0]
        assert isinstance(resp, P.CapsuleResp) and resp.cqe.ok
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A) as ctrl:
        assert ctrl.read(1, 5000, len(payload) // 512) == payload


def test_malformed_pdu_over_socket_gets_term_req(target: Target) -> None:
    with socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
        s.sendall(P.encode(P.ICReq()))
        assert s.recv(128, socket.MSG_WAITALL)[0] == P.PduType.ICRESP
        s.sendall(bytes([0x04, 0, 72, 0]) + struct.pack("<I", 7))  # PLEN < HLEN
        term = s.recv(1024, socket.MSG_WAITALL)
        assert term[0] == P.PduType.C2H_TERM_REQ
        fes, fei = struct.unpack_from("<HI", term, 8)
        assert (fes, fei) == (P.FES_INVALID_HEADER_FIELD, 4)
        assert term[24:32] == bytes([0x04, 0, 72, 0]) + struct.pack("<I", 7)
        assert s.recv(16) == b""  # and the connection is closed
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A) as ctrl:
        assert ctrl.active_namespaces() == [1, 2]  # the server keeps serving


def test_icreq_with_unsupported_hpda_is_rejected(target: Target) -> None:
    with socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
        s.sendall(P.encode(P.ICReq(hpda=3)))
        term = s.recv(1024, socket.MSG_WAITALL)
        assert term[0] == P.PduType.C2H_TERM_REQ
        assert struct.unpack_from("<HI", term, 8) == (P.FES_UNSUPPORTED_PARAMETER, 10)


def test_keep_alive_timeout_then_reconnect(target: Target) -> None:
    """A silent host loses its controller after KATO; the next I/O reconnects and works."""
    ctrl = host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_B, kato_ms=400)
    try:
        ctrl.stop_keep_alive()  # the host stops sending Keep Alive
        ctrl.write(2, 0, b"k" * 512)
        first = ctrl.cntlid
        deadline = time.monotonic() + 10
        while ctrl.admin is not None and ctrl.admin.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctrl.admin is not None and ctrl.admin.dead is not None  # target dropped it
        assert ctrl.read(2, 0, 1) == b"k" * 512  # reconnects transparently
        assert ctrl.reconnects == 1 and ctrl.cntlid != first
    finally:
        ctrl.close()


def test_clean_disconnect_deletes_controller(target: Target) -> None:
    sub = target.subsystems[NQN]
    ctrl = host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_C, io_queues=2)
    cntlid = ctrl.cntlid
    assert cntlid in sub.controllers
    ctrl.close()
    deadline = time.monotonic() + 5
    while cntlid in sub.controllers and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cntlid not in sub.controllers
    with pytest.raises(TransportError):
        ctrl.read(1, 0, 1)


@pytest.mark.parametrize("poll", [False, True])
def test_target_gone_fails_cleanly(poll: bool) -> None:
    t = Target(make_config()).start_in_thread()
    ctrl = host.connect("127.0.0.1", t.port, NQN, hostnqn=HOST_A, reconnect=1.0, timeout=2.0,
                        poll=poll)
    ctrl.write(1, 0, b"a" * 512)
    t.stop()
    started = time.monotonic()
    with pytest.raises(TransportError, match="not re-established"):
        ctrl.write(1, 0, b"b" * 512)
    assert time.monotonic() - started < 10  # bounded: no hang
    ctrl.close()


def test_silent_peer_times_out() -> None:
    """A peer that accepts TCP but never answers the ICReq: a TransportError, no hang."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        started = time.monotonic()
        with pytest.raises(TransportError, match="ICResp"):
            host.connect("127.0.0.1", srv.getsockname()[1], NQN, hostnqn=HOST_A, timeout=0.5)
        assert time.monotonic() - started < 5


def test_command_timeout_fails_queue_then_recovers(target: Target) -> None:
    """A command the target never completes (an AER) times out; the next I/O reconnects."""
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A) as ctrl:
        assert ctrl.admin is not None
        with pytest.raises(TransportError, match="no completion"):
            ctrl.admin.execute(P.Sqe(spec.ADMIN_ASYNC_EVENT), what="AER", timeout=0.3)
        assert ctrl.admin.dead is not None
        ctrl.write(1, 64, b"t" * 512)
        assert ctrl.read(1, 64, 1) == b"t" * 512 and ctrl.reconnects == 1
