"""The kernel's NVMe-oF host without a kernel that has one: what kvtool.nvme.kernel would write
to /dev/nvme-fabrics (nvme-cli's option string), URL parsing for nvme+rdma://, and the
refusals that need no kernel. tests/rdma/test_guest_rdma.py drives the real one in the guest.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvtool.cli.hostopts import credentials
from kvtool.errors import UsageError
from kvtool.nvme import kernel
from kvtool.nvme.dhchap import Secret
from kvtool.nvme.url import parse_nvme_url
from kvtool.store.kernelhost import connect_options, parse

NQN = "nqn.2026-01.io.kvtool:rdma"
HOST = "nqn.2014-08.org.nvmexpress:uuid:6b767430-0000-4000-8000-000000000001"


def test_rdma_urls() -> None:
    url = parse_nvme_url(f"nvme+rdma://10.0.2.15:4421/{NQN}/2", transports=("tcp", "rdma"))
    assert (url.transport, url.host, url.port, url.subnqn, url.nsid) == (
        "rdma", "10.0.2.15", 4421, NQN, 2)
    assert str(url) == f"nvme+rdma://10.0.2.15:4421/{NQN}/2"
    assert parse_nvme_url(f"nvme+rdma://10.0.2.15/{NQN}", transports=("rdma",)).port == 4420
    with pytest.raises(UsageError, match="not an NVMe/TCP URL"):
        parse_nvme_url(f"nvme+rdma://10.0.2.15/{NQN}")  # kvtool's own host: TCP only
    with pytest.raises(UsageError, match="takes one address"):
        parse(f"nvme+rdma://10.0.2.15:4420,10.0.2.16:4420/{NQN}")


def test_option_string_is_nvme_clis() -> None:
    """libnvme build_options: nqn, transport, traddr, trsvcid, hostnqn, hostid, then the
    numbers, then the DH-HMAC-CHAP secrets in their DHHC-1 text."""
    secret = Secret(bytes(range(32)))
    opts = connect_options(parse(f"nvme+rdma://10.0.2.15:4420/{NQN}/1"), hostnqn=HOST,
                           nr_io_queues=2)
    assert opts.option_string() == (
        f"nqn={NQN},transport=rdma,traddr=10.0.2.15,trsvcid=4420,hostnqn={HOST},"
        "hostid=6b767430-0000-4000-8000-000000000001,nr_io_queues=2,ctrl_loss_tmo=10,"
        "reconnect_delay=1")
    with_key = kernel.ConnectOptions("tcp", "127.0.0.1", 4420, NQN, HOST, "x",
                                     ctrl_loss_tmo=None, reconnect_delay=None,
                                     dhchap_secret=secret)
    assert with_key.option_string().endswith(f",dhchap_secret={secret.encode()}")
    assert secret.encode() not in repr(with_key)  # the Secret's repr has no key material


def test_hostid_follows_the_uuid_nqn() -> None:
    assert kernel.hostid_text(HOST) == "6b767430-0000-4000-8000-000000000001"
    other = kernel.hostid_text("nqn.2026-01.io.example:host1")
    assert other == kernel.hostid_text("nqn.2026-01.io.example:host1") and len(other) == 36


def test_no_fabrics_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kernel, "FABRICS_DEV", str(tmp_path / "nvme-fabrics"))
    opts = connect_options(parse(f"nvme+rdma://10.0.2.15:4420/{NQN}/1"), hostnqn=HOST)
    with pytest.raises(kernel.FabricsError, match="modprobe nvme-rdma") as exc:
        kernel.connect(opts)
    assert exc.value.errno == errno.ENOENT


def test_no_controllers_without_sysfs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kernel, "SYSFS", tmp_path)
    (tmp_path / "nvme0").mkdir()
    (tmp_path / "nvme0" / "transport").write_text("pcie\n")
    (tmp_path / "nvme4").mkdir()
    (tmp_path / "nvme4" / "transport").write_text("rdma\n")
    (tmp_path / "nvme4" / "subsysnqn").write_text(NQN + "\n")
    (tmp_path / "nvme4" / "address").write_text("traddr=10.0.2.15,trsvcid=4420\n")
    assert [c.name for c in kernel.controllers()] == ["nvme4"]
    assert [c.name for c in kernel.find("rdma", "10.0.2.15", 4420, NQN)] == ["nvme4"]
    assert kernel.find("tcp", "10.0.2.15", 4420, NQN) == []
    with pytest.raises(kernel.FabricsError, match="no NVMe-oF controller nvme0"):
        kernel.controller("/dev/nvme0")


def test_host_option() -> None:
    creds = credentials(None, None, None, f"nvme+tcp://127.0.0.1:4420/{NQN}", "kernel")
    assert creds is not None and creds.initiator == "kernel" and creds.secret is None
    with pytest.raises(UsageError, match="speaks NVMe/TCP only"):
        credentials(None, None, None, f"nvme+rdma://10.0.2.15:4420/{NQN}", "kvtool")
    assert credentials(HOST, None, None, "nvme+rdma://10.0.2.15/" + NQN).initiator is None
    with pytest.raises(UsageError, match="applies to NVMe-oF only"):
        credentials(None, None, None, "/dev/nvme0n1", "kernel")
