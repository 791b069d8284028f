"""``[spdk] start = true``: kvtool starts nvmf_tgt and hands it the config's PCIe NVMe
controllers (the config side; tests/rdma/test_guest_rdma.py applies it in the QEMU guest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.errors import InputError
from kvtool.target import api
from kvtool.target.loader import load_config
from kvtool.target.plan import TargetError
from kvtool.target.spdk import pci
from tests.conftest import FIXTURES

GUEST = FIXTURES / "targets" / "spdk-production-guest.toml"
PRODUCTION = FIXTURES / "targets" / "spdk-production.toml"


def test_production_guest_file() -> None:
    cfg = load_config(str(GUEST), allow_remote=True)
    assert cfg.backend == "spdk" and cfg.spdk_start and cfg.spdk_mem_mb == 1024
    assert cfg.spdk_cpumask == "0x1" and cfg.spdk_pci_driver == "vfio-pci"
    assert cfg.pci_controllers() == ["0000:00:11.0", "0000:00:12.0"]
    assert api.runtime_of(cfg) == "nvmf_tgt"
    assert [lst.transport for lst in cfg.listeners] == ["rdma", "rdma"]
    prod = load_config(str(PRODUCTION), allow_remote=True)
    assert not prod.spdk_start and api.runtime_of(prod) is None
    assert "spdk_start" not in prod.to_dict()  # digests of configs without it are unchanged
    assert cfg.transports == prod.transports  # the same RDMA transport options


def _write(tmp_path: Path, spdk: str, backend: str = "spdk") -> Path:
    path = tmp_path / "t.toml"
    path.write_text(f'backend = "{backend}"\n[spdk]\n{spdk}\n[[subsystem]]\n'
                    'nqn = "nqn.2026-01.io.kvtool:x"\nallow_any_host = true\n'
                    '[[subsystem.namespace]]\nnsid = 1\nbdev_name = "N0n1"\n'
                    '[subsystem.namespace.nvme]\ntrtype = "PCIe"\ntraddr = "0000:00:11.0"\n'
                    '[[listener]]\ntransport = "rdma"\naddress = "127.0.0.1"\n')
    return path


@pytest.mark.parametrize(("spdk", "backend", "message", "line"), [
    ("mem_mb = 2048", "spdk", "mem_mb applies when kvtool starts nvmf_tgt itself", 3),
    ("start = true\ncpumask = \"1\"", "spdk", "cpumask must be a hex core mask", 4),
    ("start = true\npci_driver = \"nvme\"", "spdk", "pci_driver", 4),
    ("start = true\nmem_mb = 16", "spdk", "mem_mb", 4),
    ("start = true", "nvmet", "it needs backend = \"spdk\"", 3),
])
def test_bad_start_keys(tmp_path: Path, spdk: str, backend: str, message: str,
                        line: int) -> None:
    with pytest.raises(InputError, match=message) as exc:
        load_config(str(_write(tmp_path, spdk, backend)))
    assert exc.value.line == line


def test_pci_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pci, "SYSFS", tmp_path)
    with pytest.raises(TargetError, match=r"no PCI device 0000:00:11\.0"):
        pci.bind("0000:00:11.0")
    with pytest.raises(TargetError, match="not one SPDK uses"):
        pci.bind("0000:00:11.0", "nvme")
    assert pci.driver("0000:00:11.0") is None and pci.vfio_users("0000:00:11.0") == []
