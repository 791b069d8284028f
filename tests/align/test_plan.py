from __future__ import annotations

import pytest

from kvtool.align import plan_object
from kvtool.errors import UsageError


def test_v4_flash_object_on_512() -> None:
    p = plan_object(1_002_240, 512)
    assert (p.residue, p.padded_bytes, p.lbas, p.pad_bytes) == (256, 1_002_496, 1958, 256)
    assert p.strategy == "bounce" and not p.ok
    assert p.waste_fraction == pytest.approx(256 / 1_002_496)
    assert p.bounce is not None
    assert p.bounce.scratch_bytes == 1_002_496 and p.bounce.scratch_align == 4096
    assert p.bounce.copy_in_bytes == p.bounce.copy_back_bytes == 1_002_240
    assert p.bounce.zero_fill_bytes == 256
    assert "copy back only" in p.explanation


def test_v4_flash_object_on_4096() -> None:
    p = plan_object(1_002_240, 4096)
    assert (p.residue, p.padded_bytes, p.lbas) == (2816, 1_003_520, 245)
    assert p.pad_bytes == 1_003_520 - 1_002_240 == 1280


def test_aligned_object() -> None:
    p = plan_object(33_554_432, 4096)
    assert p.strategy == "aligned" and p.ok and p.bounce is None
    assert p.lbas == 8192 and p.waste_fraction == 0


def test_scratch_alignment_follows_device_limits() -> None:
    p = plan_object(1000, 512, mem_align=4)
    assert p.bounce is not None and p.bounce.scratch_align == 512


@pytest.mark.parametrize(("nbytes", "lba", "field"), [(0, 512, "object_bytes"),
                                                       (-5, 512, "object_bytes"),
                                                       (100, 0, "lba"), (100, 1000, "lba")])
def test_bad_plan_inputs(nbytes: int, lba: int, field: str) -> None:
    with pytest.raises(UsageError) as err:
        plan_object(nbytes, lba)
    assert err.value.field == field
