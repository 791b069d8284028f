from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.align import Extent, PackedRule, audit_extents, audit_rule, parse_rule, read_extents
from kvtool.errors import InputError, UsageError


def test_packed_v4_objects_fail_at_extent_0_length() -> None:
    rule = parse_rule("packed:offset=0,count=1000", default_size=1_002_240)
    a = audit_rule(rule, lba=512)
    assert a.extents == 1000 and a.misaligned == 1000
    assert a.first_misaligned is not None
    assert a.first_misaligned.index == 0 and a.first_misaligned.problems == ("length",)


def test_padded_stride_still_fails_on_length_but_offsets_align() -> None:
    rule = parse_rule("packed:offset=0,count=10,size=1002240,stride=1002496")
    a = audit_rule(rule, lba=512)
    assert a.first_misaligned is not None and a.first_misaligned.problems == ("length",)
    ext = audit_extents(rule.extents(), lba=512)
    assert ext.misaligned == 10


def test_aligned_allocator() -> None:
    rule = parse_rule("packed:offset=100,count=1000,size=1002496,align=4096")
    assert rule.offset == 4096 and rule.stride == 1_003_520
    # 1,002,496 ≡ 3072 (mod 4096): padded for 512-B LBAs, not for 4 KiB ones
    assert audit_rule(rule, lba=4096).misaligned == 1000
    a = audit_rule(rule, lba=512)
    assert a.ok and a.misaligned == 0


def test_offset_misalignment_found_at_index_1() -> None:
    # aligned-size objects, but a stride of 512 + 4096k breaks 4 KiB offsets from extent 1
    rule = PackedRule.make(offset=0, count=8, size=4096, stride=4608)
    a = audit_rule(rule, lba=4096)
    assert a.first_misaligned is not None
    assert (a.first_misaligned.index, a.first_misaligned.offset) == (1, 4608)
    assert a.first_misaligned.problems == ("offset",)
    # offsets 4608·i ≡ 512·i (mod 4096): aligned only for i = 0 (i < 8)
    assert a.misaligned == 7


def test_rule_overlap_and_device_end() -> None:
    rule = PackedRule.make(offset=0, count=4, size=8192, stride=4096)
    a = audit_rule(rule, lba=512, device_size=3 * 4096 + 8192)
    assert a.overlap == (0, 1)
    assert a.beyond_end is None
    a = audit_rule(rule, lba=512, device_size=2 * 4096 + 8192)
    assert a.beyond_end == 3


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, 10_000), count=st.integers(1, 40), size=st.integers(1, 10_000),
       stride=st.integers(1, 12_000), lba=st.sampled_from([512, 4096]),
       dev=st.none() | st.integers(1, 500_000))
def test_closed_form_matches_extent_by_extent(offset: int, count: int, size: int, stride: int,
                                              lba: int, dev: int | None) -> None:
    rule = PackedRule.make(offset=offset, count=count, size=size, stride=stride)
    fast = audit_rule(rule, lba=lba, device_size=dev)
    slow = audit_extents(list(rule.extents()), lba=lba, device_size=dev)
    assert fast.misaligned == slow.misaligned
    assert (fast.first_misaligned is None) == (slow.first_misaligned is None)
    if fast.first_misaligned and slow.first_misaligned:
        assert fast.first_misaligned.index == slow.first_misaligned.index
        assert fast.first_misaligned.problems == slow.first_misaligned.problems
    assert (fast.overlap is None) == (slow.overlap is None)
    assert fast.beyond_end == slow.beyond_end


def test_extents_name_first_bad_and_which_value() -> None:
    a = audit_extents([(0, 4096, 0x1000), (4096, 4096, 0x2200), (8192, 1000)], lba=4096,
                      mem_align=4096)
    assert a.first_misaligned is not None
    assert a.first_misaligned.index == 1 and a.first_misaligned.problems == ("buffer",)
    assert a.misaligned == 2
    assert "0x2200" in a.first_misaligned.message


def test_extents_overlap() -> None:
    a = audit_extents([Extent(8192, 4096), Extent(0, 4096), Extent(2048, 4096)], lba=512)
    assert a.overlap == (1, 2) and not a.ok


@pytest.mark.parametrize("text", ["packed:count=x", "linear:offset=0,count=1", "packed:offset=0",
                                  "packed:offset=0,count=4,size=lots", "packed:count=3,colour=2"])
def test_bad_rules(text: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_rule(text, default_size=4096)
    assert err.value.field == "layout"


def test_read_csv(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    p.write_text("# placement\noffset,length,buffer\n0,4KiB,0x1000\n4096,1002240,\n")
    assert read_extents(p) == [Extent(0, 4096, 0x1000), Extent(4096, 1_002_240, None)]


def test_read_json_forms(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"extents": [[0, 512], {"offset": 512, "length": 1024,
                                                    "buffer": 4096}]}))
    assert read_extents(p) == [Extent(0, 512), Extent(512, 1024, 4096)]


def test_csv_error_names_line_and_field(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    p.write_text("0,4096\n4096,abc\n")
    with pytest.raises(InputError) as err:
        read_extents(p)
    assert (err.value.file, err.value.line, err.value.field) == (str(p), 2, "length")


def test_json_error_names_line(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text('[\n[0, 4096],\n[1, \n')
    with pytest.raises(InputError) as err:
        read_extents(p)
    assert err.value.line is not None and err.value.file == str(p)


def test_missing_extents_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        read_extents(tmp_path / "none.csv")
    assert err.value.field == "layout"
