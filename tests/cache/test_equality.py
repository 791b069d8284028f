"""Hits, counts, puts and times are what they were before issue 39's refactoring: every
fixture trace under every policy, every fixture cluster through the serving model, and the
public Mooncake conversation trace (tests/helpers/equality.py; numbers in equality.json,
written by the code before the refactoring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.equality import COUNTS, SHARED, cases, run_case

RECORDED = json.loads((Path(__file__).parent / "equality.json").read_text())
MOONCAKE = (SHARED / "traces" / "mooncake" / "conversation_trace.jsonl").exists()
CASES = list(cases(mooncake=True))


def test_every_case_is_recorded() -> None:
    assert {name for name, _ in CASES} == set(RECORDED)


@pytest.mark.parametrize(("name", "args"), CASES, ids=[name for name, _ in CASES])
def test_replay_is_unchanged(name: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if name.startswith("mooncake/") and not MOONCAKE:
        pytest.skip(f"public Mooncake traces not present under {SHARED}")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    found = run_case(args)
    want = RECORDED[name]
    # the counts first: they never change with the time model
    assert [{k: c[k] for k in COUNTS if k in c} for c in found["configs"]] == \
        [{k: c[k] for k in COUNTS if k in c} for c in want["configs"]]
    assert found["configs"] == want["configs"]
    assert found["digest"] == want["digest"], "the headline counts agree, some other field differs"
