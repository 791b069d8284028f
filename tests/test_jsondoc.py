"""kvtool.jsondoc: ``dump_json`` writes the same text with msgspec loaded (the standard
encoder compact, then ``msgspec.json.format``) as without (``json.dumps(indent=2)``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.jsondoc import dump_json, jsonable

_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
            | st.floats(allow_nan=True, allow_infinity=True)
            | st.text(alphabet=st.characters(codec="utf-8"), max_size=12))
DOCS = st.recursive(_SCALARS, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=30)


@pytest.mark.slow
@settings(max_examples=300)
@given(DOCS)
def test_the_formatted_text_is_json_dumps_indent_2(doc: Any) -> None:
    assert "msgspec" in sys.modules
    plain = json.dumps(jsonable(doc), indent=2)
    assert dump_json(doc) == plain
    assert json.loads(plain) == json.loads(json.dumps(jsonable(doc)))


def test_without_msgspec_loaded_the_standard_encoder_indents(tmp_path: Any) -> None:
    """A command that never loads msgspec (``kvtool load --json``) gets the same text."""
    doc = {"a": [1, 2.5, {}, []], "é": {"x": None, "inf": math.inf}, "n": "\u00d7\n\""}
    code = ("import sys, json; from kvtool.jsondoc import dump_json; "
            "doc = json.loads(sys.stdin.read()); doc['é']['inf'] = float('inf'); "
            "sys.stdout.write(dump_json(doc)); assert 'msgspec' not in sys.modules")
    doc_in = {**doc, "é": {"x": None, "inf": None}}
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(doc_in), text=True,
                         capture_output=True, check=True).stdout
    assert out == dump_json(doc)
    assert msgspec.json.decode(out) == {**doc, "é": {"x": None, "inf": None}}


def test_numpy_scalars_become_plain_numbers_and_their_inf_null() -> None:
    doc = {"i": np.int64(7), "f": np.float32(0.5), "inf": np.float64("inf"),
           "nan": np.float32("nan"), "t": (np.int8(1), 2)}
    assert json.loads(dump_json(doc)) == {"i": 7, "f": 0.5, "inf": None, "nan": None,
                                          "t": [1, 2]}
