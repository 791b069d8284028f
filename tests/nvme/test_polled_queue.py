"""Polled I/O queues: completions received on the waiting thread (kvtool.nvme.queue).

Against kvtool's target on a real socket, and against a raw socket peer for the failure
cases: callbacks run on the reaping thread, several threads share one polled queue, a
send that meets a full socket keeps receiving (the target stops reading while 16 MiB of
its replies wait), and a silent target fails the queue instead of hanging it.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator

import pytest

from emulator.nvmetcp import EmulatorConfig, NamespaceConfig, SubsystemConfig, Target
from emulator.nvmetcp.transport import PAUSE_READING_AT
from kvtool.nvme import host, spec
from kvtool.nvme import pdu as P
from kvtool.nvme.queue import Command, HostQueue, TransportError
from tests.nvme.conftest import HOST_A, NQN

MIB = 1 << 20

# a broken hand-over hangs rather than fails: fail fast instead of at the global 900 s
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def big_target() -> Iterator[Target]:
    """In-capsule data up to 1 MiB, so a write is one large send with no R2T to wait for."""
    cfg = EmulatorConfig(subsystems=[SubsystemConfig(NQN, [NamespaceConfig(1, "96MiB")],
                                                   hosts=[HOST_A])],
                       listen=["127.0.0.1:0"], in_capsule_data_size=MIB)
    t = Target(cfg).start_in_thread()
    yield t
    t.stop()


def test_reap_runs_callbacks_on_the_calling_thread(target: Target) -> None:
    """Without a reader thread nothing completes until someone reaps; then the callbacks
    run on the reaper's thread, and every read returns what was written."""
    rng = random.Random(7)
    blobs = [rng.randbytes(16384) for _ in range(12)]
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A, poll=True) as ctrl:
        assert [q.polled for q in ctrl.io] == [True] and ctrl.admin is not None
        assert not ctrl.admin.polled  # keep-alive needs the admin queue's reader thread
        for i, blob in enumerate(blobs):
            ctrl.write(1, 5000 + i * 32, blob)
        bufs = [bytearray(16384) for _ in blobs]
        seen: list[tuple[int, int]] = []
        cmds = [ctrl.submit_io(spec.IO_READ, 1, 5000 + i * 32, memoryview(b), 512,
                               on_done=lambda c: seen.append((c.cid, threading.get_ident())))[1]
                for i, b in enumerate(bufs)]
        while len(seen) < len(cmds):
            ctrl.reap()
        assert {tid for _, tid in seen} == {threading.get_ident()}
        assert all(c.done.is_set() and c.result().ok for c in cmds)
        assert [bytes(b) for b in bufs] == blobs
        assert ctrl.reap() == 0  # nothing left to receive


def test_callback_may_wait_and_submit_on_a_full_polled_queue(target: Target) -> None:
    """A callback runs on the receiving thread; when it waits for another command, or
    submits into a queue whose every slot is taken, that thread keeps receiving."""
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A, poll=True,
                      queue_depth=2) as ctrl:
        ctrl.write(1, 7000, b"\x11" * 4096)
        q = ctrl.io[0]
        assert q.depth == 2
        got: list[bytes] = []

        def on_first(cmd: Command) -> None:
            # "second" and the first of these take both slots: the second submit waits
            # for a free slot, then a synchronous wait, all on the receiving thread
            bufs = [bytearray(512), bytearray(512)]
            cmds = [ctrl.submit_io(spec.IO_READ, 1, 7001 + i, memoryview(b), 512)[1]
                    for i, b in enumerate(bufs)]
            for c in cmds:
                q.wait(c)
            got.extend(bytes(b) for b in bufs)

        first = ctrl.submit_io(spec.IO_READ, 1, 7000, memoryview(bytearray(512)), 512,
                               on_done=on_first)[1]
        second = ctrl.submit_io(spec.IO_READ, 1, 7002, memoryview(bytearray(512)), 512)[1]
        q.wait(first)
        q.wait(second)
        assert got == [b"\x11" * 512] * 2 and q.dead is None
        assert ctrl.read(1, 7003, 1) == b"\x11" * 512


def test_threads_share_one_polled_queue(target: Target) -> None:
    """Four threads on one polled queue: one receives for all, the others are handed their
    completions or take over when it leaves; nothing is lost or mixed up."""
    errors: list[BaseException] = []
    with host.connect("127.0.0.1", target.port, NQN, hostnqn=HOST_A, poll=True,
                      queue_depth=16) as ctrl:
        def worker(index: int) -> None:
            try:
                rng = random.Random(index)
                for round_ in range(25):
                    lba = 40000 + (index * 25 + round_) * 128
                    blob = rng.randbytes(rng.choice([512, 8192, 65536]))
                    ctrl.write(1, lba, blob)
                    assert ctrl.read(1, lba, len(blob) // 512) == blob
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_send_keeps_receiving_while_the_target_waits_for_us(big_target: Target) -> None:
    """40 MiB of reads queue up at the target, which stops reading past 16 MiB of unsent
    replies; then 24 MiB of in-capsule writes, far more than the socket buffers hold. The
    writes' sends can only finish if the sending thread also receives, and callbacks that
    fire meanwhile (one submits a new command) must wait for the send to end."""
    reads, writes = 40, 24
    assert reads * MIB > PAUSE_READING_AT
    rng = random.Random(3)
    old = [rng.randbytes(MIB) for _ in range(reads)]
    new = [rng.randbytes(MIB) for _ in range(writes)]
    with host.connect("127.0.0.1", big_target.port, NQN, hostnqn=HOST_A, poll=True,
                      queue_depth=128, timeout=20.0) as ctrl:
        for i, blob in enumerate(old):
            ctrl.write(1, i * MIB // 512, blob)
        bufs = [bytearray(MIB) for _ in range(reads)]
        extra = bytearray(512)
        later: list[tuple[HostQueue, Command]] = []
        finished: list[int] = []

        def on_read(cmd: Command) -> None:
            finished.append(cmd.cid)
            if len(finished) == 1:  # a callback that submits, possibly mid-send
                later.append(ctrl.submit_io(spec.IO_READ, 1, 0, memoryview(extra), 512))

        pending = [ctrl.submit_io(spec.IO_READ, 1, i * MIB // 512, memoryview(b), 512,
                                  on_done=on_read) for i, b in enumerate(bufs)]
        pending += [ctrl.submit_io(spec.IO_WRITE, 1, (reads + i) * MIB // 512,
                                   memoryview(blob), 512) for i, blob in enumerate(new)]
        for q, cmd in pending + later:
            q.wait(cmd)
        assert len(finished) == reads and len(later) == 1
        assert [bytes(b) for b in bufs] == old
        assert bytes(extra) == old[0][:512]
        for i, blob in enumerate(new):
            assert ctrl.read(1, (reads + i) * MIB // 512, MIB // 512) == blob
        assert ctrl.reconnects == 0


class _SilentPeer:
    """A raw socket 'target': answers ICReq, then sends only what the test scripts."""

    def __init__(self, script: bytes = b"") -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        self.port = self.srv.getsockname()[1]
        self.script = script
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        self.conn = conn
        conn.recv(128, socket.MSG_WAITALL)  # ICReq
        conn.sendall(P.encode(P.ICResp(pfv=0, cpda=0, maxh2cdata=131072)))
        conn.recv(72, socket.MSG_WAITALL)  # the command under test
        conn.sendall(self.script)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.srv.close()


@pytest.mark.parametrize("script", ["nothing", "half a C2HData"])
def test_silent_target_fails_a_polled_queue(script: str) -> None:
    """No completion (or a PDU cut off mid-data) within the timeout: the wait raises, the
    queue is dead, nothing hangs."""
    data = b""
    if script != "nothing":
        c2h = P.encode(P.C2HData(0, 0, bytes(4096), last=True))
        data = c2h[:24 + 100]  # the header promises 4096 bytes; 100 arrive
    peer = _SilentPeer(data)
    try:
        q = HostQueue("127.0.0.1", peer.port, qid=1, depth=4, timeout=5.0, poll=True)
        cmd = q.submit(P.Sqe(spec.IO_READ, nsid=1, cdw12=7), what="Read",
                       data_in=memoryview(bytearray(4096)))
        with pytest.raises(TransportError, match="Read: no completion"):
            q.wait(cmd, timeout=0.5)
        assert q.dead is not None and cmd.done.is_set()
        with pytest.raises(TransportError, match="down"):
            q.submit(P.Sqe(spec.IO_FLUSH, nsid=1), what="Flush")
        q.close()
    finally:
        peer.close()
