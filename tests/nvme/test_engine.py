"""The nvme+tcp:// store engine: IOEngine protocol, pipelined futures, URL/host errors, and
``kvtool load/verify/bench`` end to end against the userspace target."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from emulator.nvmetcp import Target, simple_config
from kvtool.errors import UsageError
from kvtool.nvme.engine import NvmeTcpEngine, open_nvme_tcp
from kvtool.store.engine import AlignedBuffer, IOEngine, open_engine
from tests.conftest import run, run_json
from tests.nvme.conftest import HOST_A, NQN, NQN4K, STRANGER

pytestmark = pytest.mark.integration

E2E_NQN = "nqn.2026-01.io.kvtool:e2e"


def url(target: Target, nqn: str = NQN, tail: str = "") -> str:
    return f"nvme+tcp://127.0.0.1:{target.port}/{nqn}{tail}"


def test_engine_protocol_and_describe(target: Target) -> None:
    with open_nvme_tcp(url(target, tail=f"/2?hostnqn={HOST_A}"), write=True, qd=8) as eng:
        assert isinstance(eng, IOEngine)
        assert (eng.size, eng.lba_size, eng.qd, eng.writable) == (8 << 20, 512, 8, True)
        d = eng.describe()
        assert d["kind"] == "nvme-tcp" and d["nsid"] == 2 and d["hostnqn"] == HOST_A
        assert d["max_transfer"] == 1 << 20


def test_engine_pipelined_io_larger_than_mdts(target: Target) -> None:
    buf = AlignedBuffer(4 << 20)
    out = AlignedBuffer(4 << 20)
    try:
        buf.view[:] = os.urandom(4 << 20)
        with open_nvme_tcp(url(target), write=True, qd=32, hostnqn=HOST_A) as eng:
            assert len(eng.ctrl.io) == 2
            futs = [eng.submit_write(i * (1 << 20), buf.view[i << 20: (i + 1) << 20])
                    for i in range(4)]
            futs.append(eng.submit_write(8 << 20, buf.view))  # 4 MiB: four MDTS commands
            for f in futs:
                f.result(10)
            eng.flush()
            eng.submit_read(8 << 20, out.view).result(10)
            assert bytes(out.view) == bytes(buf.view)
            eng.read_into(0, out.view[:4096])
            assert bytes(out.view[:4096]) == bytes(buf.view[:4096])
            with pytest.raises(ValueError):
                eng.read_into(100, out.view[:512])  # not block aligned
            with pytest.raises(ValueError):
                eng.read_into(eng.size, out.view[:512])  # past the end
    finally:
        buf.close()
        out.close()


def test_engine_read_only_and_errors(target: Target) -> None:
    with open_nvme_tcp(url(target, NQN4K), write=False, qd=1, hostnqn=HOST_A) as eng:
        assert eng.lba_size == 4096
        with pytest.raises(PermissionError):
            eng.write_from(0, memoryview(bytes(4096)))
    with pytest.raises(UsageError) as info:
        open_nvme_tcp(url(target), write=True, hostnqn=STRANGER)
    assert info.value.field == "target" and "not allowed" in str(info.value)
    with pytest.raises(UsageError, match="namespace 5 is not active"):
        open_nvme_tcp(url(target, tail="/5"), write=True, hostnqn=HOST_A)
    with pytest.raises(UsageError, match="cannot connect"):
        open_nvme_tcp("nvme+tcp://127.0.0.1:1/" + NQN, write=True, hostnqn=HOST_A)


def test_open_engine_dispatches_nvme_urls(target: Target) -> None:
    eng = open_engine(url(target, tail="/1"), write=False, qd=4, hostnqn=HOST_A)
    try:
        assert isinstance(eng, NvmeTcpEngine) and eng.nsid == 1
    finally:
        eng.close()
    # file-only options are refused, not silently ignored (a 512 B layout under --lba 4096)
    for opt, option in (("lba", "lba"), ("create_bytes", "create")):
        with pytest.raises(UsageError) as info:
            open_engine(url(target, tail="/1"), write=True, hostnqn=HOST_A, **{opt: 4096})
        assert info.value.field == option


@pytest.fixture(scope="module")
def e2e_target() -> Iterator[Target]:
    t = Target(simple_config(nqn=E2E_NQN, backing="160MiB", allow_any_host=True,
                             listen=["127.0.0.1:0"])).start_in_thread()
    yield t
    t.stop()


def test_cli_load_verify_bench_over_nvme_tcp(e2e_target: Target) -> None:
    target_url = url(e2e_target, E2E_NQN)
    loaded = run_json("load", target_url, "--object-bytes", "1002240", "--count", "40",
                      "--qd", "8")
    assert loaded
    verified = run("verify", target_url)
    assert verified.exit_code == 0, verified.stderr + verified.stdout
    bench = run_json("bench", target_url, "--object-bytes", "1002240", "--read-only",
                     "--pattern", "seq-read", "--qd", "1,4", "--ops", "20")
    assert bench
    # Corrupt one byte behind the store's back: verify must notice (exit 1).
    ns = e2e_target.subsystems[E2E_NQN].namespaces[1]
    start = 8 << 20
    chunk = bytearray(ns.backing.read(start, 1 << 20))
    nonzero = next(i for i, b in enumerate(chunk) if b)
    chunk[nonzero] ^= 0xFF
    ns.backing.write(start, chunk)
    assert run("verify", target_url).exit_code == 1


def test_a_batch_goes_out_in_few_sends_and_lands(target: Target,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``submit_writes``/``submit_reads`` of more blocks than the queues hold: every block
    lands and comes back, the commands beyond one MDTS split, and the capsules go out a
    queue's worth per send (not one send per command)."""
    from kvtool.nvme.queue import HostQueue

    sends: list[int] = []
    real = HostQueue._send

    def counted(self: HostQueue, parts: list[bytes | memoryview]) -> None:
        sends.append(len(parts))
        real(self, parts)

    monkeypatch.setattr(HostQueue, "_send", counted)
    n, size = 40, 32 * 1024
    src, dst = AlignedBuffer(n * size + (2 << 20)), AlignedBuffer(n * size + (2 << 20))
    try:
        src.view[:] = os.urandom(len(src.view))
        with open_nvme_tcp(url(target), write=True, qd=16, hostnqn=HOST_A) as eng:
            assert sum(q.depth for q in eng.ctrl.io) == 16  # 40 blocks: several turns
            items = [(i * size, src.view[i * size:(i + 1) * size]) for i in range(n)]
            items.append((n * size, src.view[n * size:]))  # 2 MiB: two MDTS commands
            sends.clear()
            eng.submit_writes(items).result(10)
            eng.flush()
            writes = len(sends)
            sends.clear()
            back = [(off, dst.view[off:off + len(v)]) for off, v in reversed(items)]
            eng.submit_reads(back).result(10)
            assert bytes(dst.view) == bytes(src.view)
            # 42 commands each way (one send each before). The 32 KiB writes wait for
            # their R2Ts (> 8 KiB in-capsule: slots come free one by one), the reads not
            assert len(sends) < 42 / 2 and writes < 42, (sends, writes)
    finally:
        src.close()
        dst.close()


def test_a_batch_whose_send_fails_settles_each_block_once(target: Target) -> None:
    """A queue whose socket can no longer send: the batch's future fails (no hang), and no
    block is settled twice (the failed send fails what it carried; the caller fails only
    what it had not handed over)."""
    import socket as _socket
    import threading

    from kvtool.nvme import spec as nvme_spec

    with open_nvme_tcp(url(target), write=True, qd=4, hostnqn=HOST_A, reconnect=0,
                       io_queues=1) as eng:
        calls: dict[int, int] = {}
        lock = threading.Lock()
        every = threading.Event()
        n = 12

        def done(i: int, err: BaseException | None) -> None:
            with lock:
                calls[i] = calls.get(i, 0) + 1
                if len(calls) == n:
                    every.set()
            assert err is not None

        eng.ctrl.io[0].sock.shutdown(_socket.SHUT_WR)  # sends fail; the queue is alive
        big = [memoryview(bytearray(3 << 20)) for _ in range(2)]  # three commands each
        fut = eng.submit_reads([(i * (3 << 20), b) for i, b in enumerate(big)])
        exc = fut.exception(10)  # a TimeoutError here: a block was never settled
        assert isinstance(exc, OSError) and not isinstance(exc, TimeoutError), exc
        bufs = [memoryview(bytearray(4096)) for _ in range(n)]
        eng.ctrl.submit_many(nvme_spec.IO_READ, eng.nsid,
                             [(i * 4096, b) for i, b in enumerate(bufs)], 512, done)
        assert every.wait(10), calls
        time.sleep(0.1)  # a second settlement would come now
        assert calls == dict.fromkeys(range(n), 1)
