"""SPDK's hosts → kvtool's NVMe/TCP target: spdk_nvme_identify, spdk_nvme_perf and spdk_dd.

SPDK's initiator is the one SPDK-based hosts (and Mooncake's NVMe-oF path) use. Every run
must end with no error from the tool, no warning from the target (a C2HTermReq is logged as
one) and, after the tool exits, no controller left on the target: a clean disconnect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.nvmetcp import EmulatorConfig, NamespaceConfig, SubsystemConfig, Target
from emulator.spdk import tools
from kvtool.target.spdk.install import SpdkInstall

NQN = "nqn.2026-01.io.kvtool:spdk-hosts"
# spdk_nvme_identify cannot set a host NQN (it sends a random one): its subsystem admits any.
OPEN_NQN = "nqn.2026-01.io.kvtool:spdk-open"
DISCOVERY = "nqn.2014-08.org.nvmexpress.discovery"
HOSTNQN = "nqn.2026-01.io.kvtool:spdk-host"


@pytest.fixture(scope="module")
def kvtool_target() -> Iterator[Target]:
    config = EmulatorConfig(
        subsystems=[SubsystemConfig(NQN, [NamespaceConfig(1, "64MiB"),
                                          NamespaceConfig(2, "16MiB", lba_size=4096)],
                                    hosts=[HOSTNQN]),
                     SubsystemConfig(OPEN_NQN, [NamespaceConfig(1, "16MiB", lba_size=4096)],
                                     allow_any_host=True)],
        listen=["127.0.0.1:0"])
    t = Target(config).start_in_thread()
    yield t
    t.stop()


@pytest.fixture
def target(kvtool_target: Target, caplog: pytest.LogCaptureFixture) -> Iterator[Target]:
    """The module's target; after the test, no warning logged and no controller left."""
    with caplog.at_level(logging.WARNING, logger="emulator.nvmetcp"):
        yield kvtool_target
    subs = kvtool_target.subsystems.values()
    deadline = time.monotonic() + 5
    while any(s.controllers for s in subs) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [s.nqn for s in subs if s.controllers], "an SPDK host left a controller behind"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _trid(t: Target) -> str:
    return tools.trid("127.0.0.1", t.port, NQN, HOSTNQN)


def test_identify(spdk: SpdkInstall, target: Target) -> None:
    run = tools.identify(spdk, tools.trid("127.0.0.1", target.port, OPEN_NQN))
    assert run.ok, run.output[-2000:]
    # Arbitration, Power Management, Temperature Threshold, Error Recovery: answered (issue
    # 25; tests/emulator/test_sweep.py compares the whole output with SPDK's target's).
    assert "failed" not in run.output, [ln for ln in run.output.splitlines() if "failed" in ln]
    assert "Arbitration Burst:           1" in run.output
    assert f"NVMeoF Controller at TCP (addr:127.0.0.1 subnqn:{OPEN_NQN})" in run.output
    assert "Model Number:                          kvtool emulator" in run.output
    assert "Namespace ID:1" in run.output
    assert "LBA Format #00: Data Size:  4096" in run.output


def test_identify_discovery_controller(spdk: SpdkInstall, target: Target) -> None:
    """The discovery log as SPDK reads it: the subsystems any host may see."""
    run = tools.identify(spdk, tools.trid("127.0.0.1", target.port, DISCOVERY))
    assert run.ok, run.output[-2000:]
    assert "Discovery Log Page" in run.output
    assert f"NVM Subsystem Qualified Name:          {OPEN_NQN}" in run.output
    assert f"Transport Service Identifier:          {target.port}" in run.output
    assert NQN not in run.output.replace(OPEN_NQN, "")  # not allowed for this host


def test_host_not_allowed_is_refused(spdk: SpdkInstall, target: Target,
                                     caplog: pytest.LogCaptureFixture) -> None:
    stranger = tools.trid("127.0.0.1", target.port, NQN, "nqn.2026-01.io.kvtool:stranger")
    result = tools.perf(spdk, stranger, workload="randread", qd=1, seconds=1)
    assert not result.run.timed_out and result.iops == 0
    # SCT 1 SC 0x84: Connect Invalid Host, as nvmet answers
    assert "Connect command completed with error: sct 1, sc 132" in result.run.output
    assert any("not allowed" in r.getMessage() for r in caplog.records)
    caplog.clear()  # that warning is the expected outcome


@pytest.mark.parametrize("io_size", [4096, 131072])
@pytest.mark.parametrize("qd", [1, 32])
@pytest.mark.parametrize("workload", ["randread", "randwrite", "randrw"])
def test_perf(spdk: SpdkInstall, target: Target, workload: str, qd: int, io_size: int) -> None:
    result = tools.perf(spdk, _trid(target), workload=workload, qd=qd, io_size=io_size,
                        seconds=1)
    assert result.run.ok, result.run.errors or result.run.output[-2000:]
    assert result.iops > 0 and result.max_us > 0


def test_spdk_dd_round_trip(spdk: SpdkInstall, target: Target, tmp_path: Path) -> None:
    """SPDK moves the data: a file → namespace 1 (bdev over NVMe/TCP) → another file."""
    src, back = tmp_path / "src.bin", tmp_path / "back.bin"
    src.write_bytes(os.urandom(8 * 1024 * 1024 + 4096))  # not a multiple of the 128 KiB I/O
    config = tmp_path / "bdev.json"
    config.write_text(json.dumps(tools.nvme_bdev_config("Kvt", "127.0.0.1", target.port, NQN,
                                                        HOSTNQN)))
    nbytes = src.stat().st_size
    out = tools.dd(spdk, config, ["--if", str(src), "--ob", "Kvtn1", "--bs", "131072",
                                  "--qd", "8"])
    assert out.ok, out.output[-2000:]
    blocks = (nbytes + 4095) // 4096
    out = tools.dd(spdk, config, ["--ib", "Kvtn1", "--of", str(back), "--bs", "4096",
                                  "--count", str(blocks), "--qd", "8"])
    assert out.ok, out.output[-2000:]
    data = back.read_bytes()[:nbytes]
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(src.read_bytes()).hexdigest()
    # And kvtool's target holds the same bytes: read through its own backing.
    ns = target.subsystems[NQN].namespaces[1]
    assert ns.backing.read(0, nbytes) == src.read_bytes()
