"""The nvme+tcp:// store engine: IOEngine protocol, pipelined futures, URL/host errors, and
``kvtool load/verify/bench`` end to end against the userspace target."""

from __future__ import annotations

import os
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
