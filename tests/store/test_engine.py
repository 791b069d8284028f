"""The IOEngine contract (kvtool/store/io.py) on every engine, each on a real medium: the
O_DIRECT file engine (aio and threads submission), the nvme+tcp:// engine against kvtool's
userspace target and against SPDK's nvmf_tgt (each serving a namespace backed by a real
file); then the bounce/zero-copy object path."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from emulator.nvmetcp import Target, simple_config
from kvtool.errors import UsageError
from kvtool.store.bounce import io_path, read_object, write_object
from kvtool.store.engine import AlignedBuffer, IOEngine, open_engine, submit_batch
from tests.conftest import free_port

NQN = "nqn.2026-01.io.kvtool:contract"
FILE_KINDS = ["aio", "threads"]
ENGINE_KINDS = [
    *FILE_KINDS,
    pytest.param("nvme+tcp-emulator", marks=pytest.mark.integration),
    pytest.param("nvme+tcp-spdk", marks=[pytest.mark.spdk, pytest.mark.integration,
                                         pytest.mark.slow]),
]


@dataclass
class Medium:
    """An engine and the file its bytes land in (the namespace's backing file for
    nvme+tcp://)."""

    engine: IOEngine
    path: Path


@contextlib.contextmanager
def _spdk_namespace(request: pytest.FixtureRequest, path: Path) -> Iterator[str]:
    """SPDK's nvmf_tgt serving ``path`` (an AIO bdev) as namespace 1; yields its URL."""
    from kvtool.target.spdk.app import SpdkApp

    app = SpdkApp(request.getfixturevalue("spdk"), die_with_parent=True).start()
    try:
        port = free_port()
        app.rpc("nvmf_create_transport", {"trtype": "TCP"})
        app.rpc("bdev_aio_create", {"name": "Aio0", "filename": str(path), "block_size": 512})
        app.rpc("nvmf_create_subsystem", {"nqn": NQN, "allow_any_host": True,
                                          "serial_number": "KVTCONTRACT"})
        app.rpc("nvmf_subsystem_add_ns", {"nqn": NQN, "namespace": {"bdev_name": "Aio0",
                                                                      "nsid": 1}})
        app.rpc("nvmf_subsystem_add_listener", {"nqn": NQN, "listen_address": {
            "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": str(port)}})
        yield f"nvme+tcp://127.0.0.1:{port}/{NQN}/1"
    finally:
        app.stop()


@pytest.fixture(params=ENGINE_KINDS)
def medium(request: pytest.FixtureRequest, blank_file: Callable[[int], Path]) -> Iterator[Medium]:
    kind = request.param
    path = blank_file(8 << 20)
    with contextlib.ExitStack() as stack:
        if kind in FILE_KINDS:
            e = open_engine(str(path), write=True, qd=4, submission=kind)
            assert e.describe()["submission"] == kind
        elif kind == "nvme+tcp-emulator":
            target = Target(simple_config(nqn=NQN, backing=str(path), allow_any_host=True,
                                          listen=["127.0.0.1:0"])).start_in_thread()
            stack.callback(target.stop)
            e = open_engine(f"nvme+tcp://127.0.0.1:{target.port}/{NQN}/1", write=True, qd=4)
        else:
            e = open_engine(stack.enter_context(_spdk_namespace(request, path)), write=True,
                            qd=4)
        stack.callback(e.close)
        yield Medium(e, path)


@pytest.fixture
def engine(medium: Medium) -> IOEngine:
    return medium.engine


@pytest.fixture(params=FILE_KINDS)
def file_engine(request: pytest.FixtureRequest, blank_file: Callable[[int], Path]
                ) -> Iterator[IOEngine]:
    e = open_engine(str(blank_file(8 << 20)), write=True, qd=4, submission=request.param)
    yield e
    e.close()


def test_satisfies_the_protocol(engine: IOEngine) -> None:
    assert isinstance(engine, IOEngine)
    assert engine.size == 8 << 20 and engine.lba_size in (512, 4096)
    assert engine.describe()["kind"] in ("file", "nvme-tcp")
    assert engine.writable and engine.qd == 4


def test_round_trip_through_the_medium(medium: Medium) -> None:
    engine = medium.engine
    buf = AlignedBuffer(1 << 20)
    np.frombuffer(buf.view, dtype=np.uint8)[:] = np.arange(1 << 20) % 251
    engine.write_from(4096, buf.view)
    engine.flush()
    back = AlignedBuffer(1 << 20)
    engine.read_into(4096, back.view)
    assert bytes(back.view) == bytes(buf.view)
    # and it really is on the medium after the flush, visible to an ordinary read
    with open(medium.path, "rb") as f:
        f.seek(4096)
        assert f.read(1 << 20) == bytes(buf.view)


def test_async_submissions(engine: IOEngine) -> None:
    bufs = [AlignedBuffer(65536) for _ in range(16)]
    for i, b in enumerate(bufs):
        b.view[:] = bytes([i]) * 65536
    futs = [engine.submit_write(i * 65536, b.view) for i, b in enumerate(bufs)]
    for f in futs:
        f.result()
    outs = [AlignedBuffer(65536) for _ in range(16)]
    for f in [engine.submit_read(i * 65536, o.view) for i, o in enumerate(outs)]:
        f.result()
    assert all(o.view[100] == i for i, o in enumerate(outs))


def test_alignment_contract_is_enforced(engine: IOEngine) -> None:
    buf = AlignedBuffer(8192)
    lba = engine.lba_size
    with pytest.raises(ValueError, match="logical block"):
        engine.read_into(lba // 2, buf.view[:lba])
    with pytest.raises(ValueError, match="logical block"):
        engine.read_into(0, buf.view[:lba + 1])
    if engine.mem_align > 1:  # O_DIRECT: the buffer's address must be aligned too
        with pytest.raises(ValueError, match="not aligned"):
            engine.read_into(0, buf.view[1:lba + 1])
    else:  # NVMe/TCP copies through a socket: any address is aligned to 1
        engine.read_into(0, buf.view[1:lba + 1])
    with pytest.raises(ValueError, match="past the namespace"):
        engine.read_into(engine.size, buf.view[:lba])


def test_read_only_engine_refuses_writes(blank_file: Callable[[int], Path]) -> None:
    e = open_engine(str(blank_file(1 << 20)), write=False)
    try:
        with pytest.raises(PermissionError):
            e.write_from(0, AlignedBuffer(4096).view)
    finally:
        e.close()


def test_bad_targets(store_dir: Path) -> None:
    with pytest.raises(UsageError, match="no such file") as exc:
        open_engine(str(store_dir / "missing.img"), write=True)
    assert exc.value.field == "target"
    with pytest.raises(UsageError, match="not a block device or regular file"):
        open_engine(str(store_dir), write=False)
    assert not (store_dir / "missing.img").exists()
    with pytest.raises(UsageError, match="unsupported URL scheme 'nvme\\+fc://'"):
        open_engine("nvme+fc://127.0.0.1:4420/nqn.2026-01.io.kvtool:x/1", write=True)
    with pytest.raises(UsageError, match="not an NVMe-oF namespace") as exc:
        open_engine("nvme+rdma://127.0.0.1:4420/nqn.2026-01.io.kvtool:x/1", write=True,
                    create_bytes=1 << 20)
    assert exc.value.field == "create"
    with pytest.raises(UsageError, match="speaks NVMe/TCP only") as exc:
        open_engine("nvme+rdma://127.0.0.1:4420/nqn.2026-01.io.kvtool:x/1", write=True,
                    host="kvtool")
    assert exc.value.field == "host"


def test_create_and_lba_override(store_dir: Path) -> None:
    path = store_dir / "new.img"
    e = open_engine(str(path), write=True, create_bytes=3 << 20, lba=4096)
    try:
        assert e.lba_size == 4096 and e.size == 3 << 20
        assert os.stat(path).st_blocks * 512 >= 3 << 20  # allocated, not sparse
    finally:
        e.close()
    with pytest.raises(UsageError, match="power-of-two multiple"):
        open_engine(str(path), write=False, lba=1000)


@pytest.mark.parametrize("nbytes", [1, 511, 513, 4095, 1_002_240])
def test_bounce_path_copies_back_only_the_object(engine: IOEngine, nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, size=nbytes, dtype=np.uint8)
    assert io_path(memoryview(data), engine.lba_size, engine.mem_align) == "bounce"
    scratch = AlignedBuffer(2 << 20)
    np.frombuffer(scratch.view, dtype=np.uint8)[:] = 0xEE  # dirty scratch: pad must be zeroed
    write_object(engine, 1 << 20, memoryview(data), scratch).result()
    out = np.full(nbytes + 100, 0x5A, dtype=np.uint8)
    read_object(engine, 1 << 20, nbytes, memoryview(out), AlignedBuffer(2 << 20))
    assert np.array_equal(out[:nbytes], data)
    assert (out[nbytes:] == 0x5A).all()  # nothing past the object is touched
    padded = -(-nbytes // engine.lba_size) * engine.lba_size
    raw = AlignedBuffer(padded)
    engine.read_into(1 << 20, raw.view)
    assert not any(raw.view[nbytes:])  # the pad on the medium is zeros


def test_zero_copy_path_for_aligned_objects(engine: IOEngine) -> None:
    buf = AlignedBuffer(1 << 20)
    assert io_path(buf.view, engine.lba_size, engine.mem_align) == "zero-copy"
    buf.view[:] = b"\x42" * (1 << 20)
    write_object(engine, 0, buf.view).result()
    out = AlignedBuffer(1 << 20)
    read_object(engine, 0, 1 << 20, out.view)
    assert bytes(out.view) == bytes(buf.view)


def test_failed_request_raises_from_its_future(file_engine: IOEngine) -> None:
    """The file shrinks under the engine: the read past the new end comes back short, and
    the future (not the reaper) reports it."""
    os.truncate(file_engine.describe()["target"], 4 << 20)
    buf = AlignedBuffer(1 << 20)
    with pytest.raises(OSError):
        file_engine.submit_read(6 << 20, buf.view).result(10)
    file_engine.submit_read(0, buf.view).result(10)  # the engine keeps working


def test_more_submissions_than_qd_all_complete(engine: IOEngine) -> None:
    bufs = [AlignedBuffer(4096) for _ in range(64)]
    for i, b in enumerate(bufs):
        b.view[:] = bytes([i]) * 4096
    for f in [engine.submit_write(i * 4096, b.view) for i, b in enumerate(bufs)]:
        f.result(10)
    engine.flush()
    out = [AlignedBuffer(4096) for _ in range(64)]
    for f in [engine.submit_read(i * 4096, o.view) for i, o in enumerate(out)]:
        f.result(10)
    assert [o.view[0] for o in out] == list(range(64))


def test_batched_submissions_round_trip(engine: IOEngine) -> None:
    """submit_batch: more requests than the queue depth, one future for all of them."""
    bufs = [AlignedBuffer(4096) for _ in range(37)]
    for i, b in enumerate(bufs):
        b.view[:] = bytes([i]) * 4096
    submit_batch(engine, [(i * 4096, b.view) for i, b in enumerate(bufs)], write=True).result(10)
    engine.flush()
    out = [AlignedBuffer(4096) for _ in range(37)]
    fut = submit_batch(engine, [(i * 4096, o.view) for i, o in enumerate(out)])
    assert fut.result(10) is None
    assert [o.view[0] for o in out] == list(range(37))
    assert submit_batch(engine, []).result(10) is None


def test_batch_with_a_failed_request_fails_only_once_all_are_done(
        file_engine: IOEngine) -> None:
    """One read of a batch comes back short (the file shrank under the engine): the
    batch's future raises, but only after every other read of it has landed (their
    buffers were the kernel's until then), and the engine keeps working."""
    path = file_engine.describe()["target"]
    with open(path, "r+b") as f:
        f.write(bytes(range(256)) * (64 * 1024))
    os.truncate(path, 4 << 20)
    bufs = [AlignedBuffer(4096) for _ in range(12)]
    items = [(i * 4096, b.view) for i, b in enumerate(bufs[:11])] + [(6 << 20, bufs[11].view)]
    fut = submit_batch(file_engine, items)
    with pytest.raises(OSError):
        fut.result(10)
    for i, b in enumerate(bufs[:11]):
        assert bytes(b.view[:4]) == bytes(range(256))[(i * 4096) % 256:][:4]
    submit_batch(file_engine, [(0, bufs[0].view)]).result(10)


def test_aio_io_submit_taking_part_of_a_batch(blank_file: Callable[[int], Path]) -> None:
    """The kernel may take only some iocbs of an io_submit, or refuse one: the rest are
    submitted again, the refused one fails its batch, and nothing is lost or doubled."""
    from kvtool.store.aio import AioQueue

    e = open_engine(str(blank_file(8 << 20)), write=True, qd=8, submission="aio")
    try:
        aio = e._aio  # type: ignore[attr-defined]
        assert isinstance(aio, AioQueue)
        calls: list[int] = []
        real = aio._io_submit

        def partial(ptrs: object, n: int) -> int:
            calls.append(n)
            if len(calls) == 1:
                return -errno.EAGAIN  # retried
            if len(calls) == 2 and n > 2:
                return real(ptrs, 2)  # two of them taken
            if len(calls) == 3:
                return -errno.EINVAL  # the next one refused
            return real(ptrs, n)

        aio._io_submit = partial
        bufs = [AlignedBuffer(4096) for _ in range(6)]
        for i, b in enumerate(bufs):
            b.view[:] = bytes([i + 1]) * 4096
        fut = e.submit_writes([(i * 4096, b.view) for i, b in enumerate(bufs)])
        with pytest.raises(OSError, match="io_submit"):
            fut.result(10)
        assert calls[:4] == [6, 6, 4, 3]
        aio._io_submit = real
        out = AlignedBuffer(6 * 4096)
        e.read_into(0, out.view)
        got = [out.view[i * 4096] for i in range(6)]
        assert got == [1, 2, 0, 4, 5, 6]  # the refused third write never happened
        assert not aio._inflight and not aio._waiting
    finally:
        e.close()


def test_aio_reap_on_the_callers_thread(file_engine: IOEngine) -> None:
    """reap() takes the completions that have arrived without waiting; together with the
    reaper thread every batch resolves exactly once."""
    bufs = [AlignedBuffer(4096) for _ in range(24)]
    futs = [submit_batch(file_engine, [(i * 4096, b.view) for i, b in
                                       enumerate(bufs[k:k + 6], start=k)])
            for k in range(0, 24, 6)]
    reap = file_engine.reap  # type: ignore[attr-defined]
    while not all(f.done() for f in futs):
        reap()
    assert all(f.result(10) is None for f in futs)


def test_aio_batches_completed_by_their_waiter(blank_file: Callable[[int], Path]) -> None:
    """on_caller batches go to an AIO context without a reaper thread: waiting for the
    future (result, exception) takes the completions on the waiting thread, a batch
    larger than the queue depth included, and callbacks still run."""
    import threading

    e = open_engine(str(blank_file(8 << 20)), write=True, qd=4, submission="aio")
    try:
        threads = set(threading.enumerate())  # (an earlier test's may still be ending)
        bufs = [AlignedBuffer(4096) for _ in range(11)]
        for i, b in enumerate(bufs):
            b.view[:] = bytes([i + 7]) * 4096
        seen: list[bool] = []
        fut = submit_batch(e, [(i * 4096, b.view) for i, b in enumerate(bufs)], write=True,
                           on_caller=True)
        fut.add_done_callback(lambda f: seen.append(f.exception() is None))
        assert fut.result(10) is None and seen == [True]
        assert not set(threading.enumerate()) - threads  # no reaper thread was started
        out = [AlignedBuffer(4096) for _ in range(11)]
        back = submit_batch(e, [(i * 4096, o.view) for i, o in enumerate(out)], on_caller=True)
        assert back.exception(10) is None
        assert [o.view[0] for o in out] == [i + 7 for i in range(11)]
        submit_batch(e, [(0, out[0].view)], on_caller=True)  # close() completes it
    finally:
        e.close()


def test_a_file_on_tmpfs_runs_a_waited_batch_on_the_caller(tmp_path: Path) -> None:
    """On tmpfs a transfer is a memory copy done inside the call that submits it: a
    batch whose caller waits for it (``on_caller``) runs there as blocking calls — its
    future is done on return, no AIO context is made for it — and round-trips the bytes;
    a batch nobody waits for, or an explicit ``submission``, still goes through AIO. A
    file on a disk filesystem is not inline."""
    from kvtool.store.direct import completes_inline
    from kvtool.store.io import AlignedBuffer, submit_batch

    shm = Path("/dev/shm")
    if not shm.is_dir() or not completes_inline(shm.stat().st_dev):
        pytest.skip("/dev/shm is not a tmpfs here")
    assert not completes_inline(Path(__file__).stat().st_dev)
    path = shm / f"kvtool-test-inline-{os.getpid()}-{tmp_path.name}.img"
    try:
        e = open_engine(str(path), write=True, qd=4, create_bytes=8 << 20)
        try:
            assert getattr(e, "inline", False)
            src, dst = AlignedBuffer(6 * 4096), AlignedBuffer(6 * 4096)
            np.frombuffer(src.view, np.uint8)[:] = np.arange(6 * 4096) % 251
            items = [(i * 8192, src.view[i * 4096:(i + 1) * 4096]) for i in range(6)]
            fut = submit_batch(e, items, write=True, on_caller=True)
            assert fut.done() and fut.exception() is None
            back = [(off, dst.view[i * 4096:(i + 1) * 4096]) for i, (off, _b) in enumerate(items)]
            fut = submit_batch(e, back, on_caller=True)
            assert fut.done() and fut.exception() is None
            assert bytes(dst.view) == bytes(src.view)
            assert getattr(e, "_own", None) is None  # no caller-reaped AIO context made
            submit_batch(e, back).result(timeout=10)  # not waited for on the caller: AIO
            assert bytes(dst.view) == bytes(src.view)
        finally:
            e.close()
        explicit = open_engine(str(path), write=False, qd=4, submission="aio")
        try:
            assert not getattr(explicit, "inline", True)
        finally:
            explicit.close()
    finally:
        path.unlink(missing_ok=True)
