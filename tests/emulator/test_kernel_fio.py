"""The Linux kernel's nvme-tcp host (QEMU guest) runs fio --verify=crc32c on a kvtool target
namespace: sequential and random writes at QD 1 and 32 (64 MiB here; bench/nvme_kernel_fio.py
does ≥ 1 GiB), every block verified by fio, then kvtool's host, the guest and the backing file
see the same bytes. One guest boot (about 30 s in all)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from emulator.qemu.build import GuestImage
from emulator.qemu.kernel_fio import ok, run

pytestmark = [pytest.mark.qemu, pytest.mark.integration, pytest.mark.slow]


def test_fio_verify_through_the_kernel_host(guest_image: GuestImage, tmp_path: Path) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed here (make test installs it)")
    result = run(64, tmp_path)
    assert [j["job"] for j in result["jobs"]] == ["seq-qd32", "rand-qd32", "seq-qd1", "rand-qd1"]
    assert all(j["errors"] == 0 and j["verified_mib"] == j["mib"] for j in result["jobs"])
    assert result["views_agree"], result
    assert result["discard_and_zeroout_read_zeros"]
    assert ok(result)
