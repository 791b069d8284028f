import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool.errors import UsageError
from kvtool.units import Capacity, format_size, parse_percent, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512", 512),
        ("0", 0),
        ("4KiB", 4096),
        ("4 KiB", 4096),
        ("4k", 4096),
        ("1M", 1 << 20),
        ("429.5GB", 429_500_000_000),
        ("46.09TB", 46_090_000_000_000),
        ("1.5MiB", 1_572_864),
        ("1002240", 1_002_240),
        ("2gb", 2_000_000_000),
        ("1PiB", 1 << 50),
        ("10B", 10),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-5", "4XB", "1.1B", "0.3", "GB", "4 K i B", "1e3", "nan"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_size(text, field="--dram")
    assert "--dram" in str(err.value)


def test_parse_size_zero_not_allowed() -> None:
    with pytest.raises(UsageError):
        parse_size("0", allow_zero=False)


@given(st.integers(min_value=0, max_value=1 << 60))
def test_plain_integers_round_trip(n: int) -> None:
    assert parse_size(str(n)) == n


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_then_parse_is_close(n: int) -> None:
    text = format_size(n).replace(" ", "")
    back = parse_size(text) if "." not in text else None
    if back is not None:
        assert back == n


def test_format_size() -> None:
    assert format_size(4096) == "4 KiB"
    assert format_size(512) == "512 B"
    assert format_size(429.5e9) == "429.50 GB"
    assert format_size(2_000_000_000) == "2 GB"


def test_capacity_units() -> None:
    assert Capacity.parse("5859blk").blocks(1, 256) == 5859
    assert Capacity.parse("3000000tok").blocks(1, 512) == 3_000_000 // 512
    assert Capacity.parse("3000000tok").blocks(1, 256) == 3_000_000 // 256
    assert Capacity.parse("1GiB").blocks(1 << 20, 256) == 1024
    assert math.isinf(Capacity.parse("inf").blocks(1, 1))
    assert Capacity.parse("0").is_zero
    with pytest.raises(UsageError):
        Capacity.parse("1.5blk")
    with pytest.raises(UsageError):
        Capacity.parse("lots")


def test_percent() -> None:
    assert parse_percent("80%") == pytest.approx(0.8)
    assert parse_percent("0.5") == 0.5
    for bad in ["0%", "120%", "x"]:
        with pytest.raises(UsageError):
            parse_percent(bad)
