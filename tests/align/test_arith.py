from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool.align import check_alignment, lbas, padded_size, residue, round_down, round_up
from kvtool.errors import UsageError


def test_report_example() -> None:
    # 1,002,240 = 1957·512 + 256 = 244·4096 + 2816
    assert residue(1_002_240, 512) == 1_002_240 - 1957 * 512 == 256
    assert padded_size(1_002_240, 512) == 1958 * 512 == 1_002_496
    assert lbas(1_002_240, 512) == 1958
    assert residue(1_002_240, 4096) == 1_002_240 - 244 * 4096 == 2816
    assert padded_size(1_002_240, 4096) == 245 * 4096 == 1_003_520
    assert lbas(1_002_240, 4096) == 245


def test_edges() -> None:
    assert round_up(0, 512) == 0 and lbas(0, 512) == 0
    assert round_up(512, 512) == 512 and round_up(513, 512) == 1024
    assert round_down(1023, 512) == 512
    with pytest.raises(ValueError):
        round_up(-1, 512)
    with pytest.raises(ValueError):
        residue(10, 0)


@given(st.integers(min_value=0, max_value=1 << 50), st.sampled_from([1, 512, 4096, 65536]))
def test_padding_invariants(n: int, a: int) -> None:
    p = padded_size(n, a)
    assert p % a == 0 and n <= p < n + a
    assert lbas(n, a) * a == p
    assert (residue(n, a) == 0) == (p == n)


@pytest.mark.parametrize("bad", [0, -512, 1000, 3])
def test_check_alignment(bad: int) -> None:
    with pytest.raises(UsageError) as err:
        check_alignment(bad)
    assert err.value.field == "lba"
    assert check_alignment(4096) == 4096
