"""A replay decodes its trace once (after the reader's pass 1): data mode's preparation,
each configuration's pass, the serving model's times and the hit-ratio bound share one
list of requests (kvtool.replay.job.ReplayJob.requests)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtool.replay.run import ReplaySettings, prepare
from kvtool.tiers.option import TierOption
from kvtool.trace.reader import TraceReader
from tests.conftest import FIXTURES

TRACE = str(FIXTURES / "traces" / "multiturn-8x12.jsonl")


@pytest.mark.parametrize("simulate", [True, False], ids=["simulate", "data"])
def test_the_trace_is_decoded_once_per_run(monkeypatch: pytest.MonkeyPatch,
                                           simulate: bool) -> None:
    passes: list[int] = []
    real = TraceReader.__iter__

    def counting(self: TraceReader) -> Any:
        passes.append(1)
        return real(self)

    monkeypatch.setattr(TraceReader, "__iter__", counting)
    tiers = {"dram": TierOption.parse("40blk", tier="dram")}
    job = prepare(ReplaySettings(TRACE, simulate=simulate, tiers=tiers, block_bytes=4096,
                                 compares=("dram=20blk", "dram=80blk")))
    doc = job.run()
    assert len(doc["configs"]) == 3
    assert len(passes) == 1
