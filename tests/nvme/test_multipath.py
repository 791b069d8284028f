"""kvtool's host over several paths (``nvme+tcp://A,B/NQN/1``) against kvtool's target with
two listeners: I/O only on optimized paths, failover with no error to the caller when a
path turns inaccessible or its listener dies, a wait (not an error) while no path is
usable, and the URL form."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from emulator.nvmetcp.config import EmulatorConfig, NamespaceConfig, SubsystemConfig
from emulator.nvmetcp.target import Target
from kvtool.errors import UsageError
from kvtool.nvme.engine import open_nvme_tcp
from kvtool.nvme.multipath import MultipathEngine
from kvtool.nvme.url import parse_nvme_url

NQN = "nqn.2026-01.io.kvtool:mpath"
CHUNK = 64 << 10


@pytest.fixture
def target() -> Iterator[Target]:
    sub = SubsystemConfig(nqn=NQN, allow_any_host=True, namespaces=[NamespaceConfig(1, "16MiB")])
    t = Target(EmulatorConfig(subsystems=[sub], listen=["127.0.0.1:0", "127.0.0.1:0"],
                            kato_grace_s=1.0).validate()).start_in_thread()
    t.config.listen = [f"{h}:{p}" for h, p in t.addresses]
    yield t
    t.stop()


def url(t: Target) -> str:
    return f"nvme+tcp://{t.config.listen[0]},{t.config.listen[1]}/{NQN}/1"


def by_path(eng: MultipathEngine) -> dict[str, dict[str, Any]]:
    return {p["address"]: p for p in eng.stats()["paths"]}


def wait_for(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


class Writer:
    """Writes and reads back distinct chunks in a loop on its own thread; counts errors."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng
        self.errors: list[BaseException] = []
        self.done = 0
        self.stop = threading.Event()
        self.written: dict[int, bytes] = {}
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            off = (i % 128) * CHUNK
            data = os.urandom(CHUNK)
            try:
                self.eng.write_from(off, memoryview(data))
                self.written[off] = data
                back = bytearray(CHUNK)
                self.eng.read_into(off, memoryview(back))
                if back != data:
                    self.errors.append(AssertionError(f"corrupt chunk at {off}"))
            except BaseException as exc:
                self.errors.append(exc)
            i += 1
            self.done += 1

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def test_url_with_several_addresses() -> None:
    u = parse_nvme_url("nvme+tcp://127.0.0.1:4420,[::1]:4421,10.0.0.2/nqn.2026-01.io.kvtool:x/3")
    assert u.paths == (("127.0.0.1", 4420), ("::1", 4421), ("10.0.0.2", 4420))
    assert str(u) == "nvme+tcp://127.0.0.1:4420,[::1]:4421,10.0.0.2:4420/nqn.2026-01.io.kvtool:x/3"
    assert parse_nvme_url("nvme+tcp://127.0.0.1/nqn.2026-01.io.kvtool:x").alternates == ()
    for bad in ("nvme+tcp://127.0.0.1:4420,127.0.0.1:4420/nqn.2026-01.io.kvtool:x",
                "nvme+tcp://127.0.0.1:4420,/nqn.2026-01.io.kvtool:x",
                "nvme+tcp://127.0.0.1:4420,h:99999/nqn.2026-01.io.kvtool:x"):
        with pytest.raises(UsageError):
            parse_nvme_url(bad)


def test_io_goes_to_the_optimized_path_only(target: Target) -> None:
    p1, p2 = target.config.listen
    target.set_ana({p2: {"1": "non-optimized"}})
    with open_nvme_tcp(url(target), write=True, qd=4) as eng:
        assert isinstance(eng, MultipathEngine)
        for i in range(20):
            eng.write_from(i * CHUNK, memoryview(os.urandom(CHUNK)))
        paths = by_path(eng)
        assert paths[p1]["ana_state"] == "optimized" and paths[p1]["completed"] == 20
        assert paths[p2]["ana_state"] == "non-optimized" and paths[p2]["completed"] == 0
        assert eng.describe()["engine"] == "nvme-tcp-multipath"
        # both optimized: round-robin over both
        target.set_ana({})
        wait_for(lambda: by_path(eng)[p2]["ana_state"] == "optimized")  # the ANA notice
        for i in range(20):
            eng.write_from(i * CHUNK, memoryview(os.urandom(CHUNK)))
        assert by_path(eng)[p2]["completed"] >= 9


def test_failover_on_ana_flips_and_a_dead_listener_loses_nothing(target: Target) -> None:
    p1, p2 = target.config.listen
    with open_nvme_tcp(url(target), write=True, qd=8) as eng, Writer(eng) as w:
        assert isinstance(eng, MultipathEngine)
        for ana in ({p1: {"1": "inaccessible"}}, {p2: {"1": "inaccessible"}},
                    {p1: {"1": "inaccessible"}}, {}):
            target.set_ana(ana)
            n = w.done
            wait_for(lambda n=n: w.done > n + 20)
        target.set_closed([p1])  # the listener dies: its connections drop
        n = w.done
        wait_for(lambda: w.done > n + 50 and by_path(eng)[p1]["state"] == "down")
        target.set_closed([])
        wait_for(lambda: by_path(eng)[p1]["state"] == "live")  # reconnected
        n = w.done
        wait_for(lambda: w.done > n + 20)
        stats = eng.stats()
    assert w.errors == []
    causes = [f["cause"] for f in stats["failovers"]]
    assert sum("naccessible" in c for c in causes) >= 2  # a failed I/O or the ANA log says so
    assert any("naccessible" not in c for c in causes)  # the connection loss
    assert all(0 <= f["failover_s"] < 5 for f in stats["failovers"])
    # everything acknowledged is there, read back through a fresh single path
    with open_nvme_tcp(f"nvme+tcp://{p2}/{NQN}/1", write=False) as single:
        for off, data in w.written.items():
            back = bytearray(CHUNK)
            single.read_into(off, memoryview(back))
            assert back == data


def test_no_usable_path_waits_then_completes(target: Target) -> None:
    p1, p2 = target.config.listen
    with open_nvme_tcp(url(target), write=True, qd=2) as eng:
        assert isinstance(eng, MultipathEngine)
        target.set_ana({p1: {"1": "inaccessible"}, p2: {"1": "inaccessible"}})
        wait_for(lambda: all(p["ana_state"] == "inaccessible" for p in by_path(eng).values()))
        data = os.urandom(CHUNK)
        fut = eng.submit_write(0, memoryview(data))
        time.sleep(0.5)
        assert not fut.done()  # waiting for a path, not failed
        target.set_ana({p2: {"1": "inaccessible"}})
        fut.result(timeout=10)
        back = bytearray(CHUNK)
        eng.read_into(0, memoryview(back))
        assert back == data and by_path(eng)[p2]["completed"] == 0


def test_no_path_for_longer_than_the_failover_timeout_fails(target: Target) -> None:
    p1, p2 = target.config.listen
    with open_nvme_tcp(url(target), write=True, qd=2, failover_timeout=0.5) as eng:
        target.set_closed([p1, p2])
        with pytest.raises(OSError, match="no usable path"):
            eng.write_from(0, memoryview(os.urandom(CHUNK)))


def test_queue_depth_policy_and_one_dead_path_at_open(target: Target) -> None:
    p1, p2 = target.config.listen
    target.set_closed([p2])
    with open_nvme_tcp(url(target), write=True, qd=8, multipath_policy="queue-depth") as eng:
        assert isinstance(eng, MultipathEngine)
        assert eng.stats()["policy"] == "queue-depth"
        assert by_path(eng)[p2]["state"] == "down"
        eng.write_from(0, memoryview(os.urandom(CHUNK)))
        target.set_closed([])
        wait_for(lambda: by_path(eng)[p2]["state"] == "live")
        futs = [eng.submit_write(i * CHUNK, memoryview(os.urandom(CHUNK))) for i in range(64)]
        for f in futs:
            f.result(timeout=10)
        assert by_path(eng)[p2]["completed"] > 0
    target.set_closed([p1, p2])
    with pytest.raises(UsageError, match="no path"):
        open_nvme_tcp(url(target), write=True)


def test_paths_from_discovery_on_a_target_that_lists_only_the_port_asked(
        target: Target) -> None:
    """kvtool's discovery controller, like Linux nvmet's, lists only the port asked: with
    one address the URL stays one path (SPDK lists every listener: tests/spdk/test_ana.py)."""
    p1 = target.config.listen[0]
    u = parse_nvme_url(f"nvme+tcp://{p1}/{NQN}/1?paths=discover")
    assert u.discover_paths and str(u).endswith("?paths=discover")
    with open_nvme_tcp(str(u), write=False) as eng:
        assert not isinstance(eng, MultipathEngine)
    with pytest.raises(UsageError, match="paths= takes only"):
        parse_nvme_url(f"nvme+tcp://{p1}/{NQN}/1?paths=all")
