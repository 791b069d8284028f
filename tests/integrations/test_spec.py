"""The tier words an engine integration takes (:mod:`kvtool.integrations.spec`): no engine
needed."""

from __future__ import annotations

import pytest

from kvtool.errors import UsageError
from kvtool.integrations.spec import KEYS, StoreSpec


def test_the_keys_parse_and_round_trip() -> None:
    spec = StoreSpec.parse({"dram": "1GiB@/dev/shm/kv-{rank}",
                            "nvme": "nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:kv-{rank}/1",
                            "policy": "lru", "write_policy": "write-back", "read_qd": 8})
    assert spec.dram is not None and spec.nvme is not None
    assert spec.write_policy == "write-back" and spec.read_qd == 8
    assert spec.commit_interval == 0.25  # the default group commit
    assert StoreSpec.parse({"dram": "1GiB", "commit_interval": "0"}).commit_interval == 0
    assert set(spec.to_dict()) <= set(KEYS)
    assert StoreSpec.parse(spec.to_dict()) == spec


@pytest.mark.parametrize(("values", "key"), [
    ({"dram": "1GiB", "colour": "red"}, "colour"),
    ({"dram": "1GiB", "write_policy": "sometimes"}, "write_policy"),
    ({"dram": "1GiB", "on_tier_error": "ignore"}, "on_tier_error"),
    ({"dram": "1GiB", "commit_interval": -1}, "commit_interval"),
    ({"dram": "1GiB", "commit_interval": "soon"}, "commit_interval"),
    ({"dram": "1GiB", "commit_interval": True}, "commit_interval"),
    ({}, "nvme"),
])
def test_a_bad_key_names_itself(values: dict[str, object], key: str) -> None:
    with pytest.raises(UsageError) as err:
        StoreSpec.parse(values, where="kv_connector_extra_config.")
    assert f"kv_connector_extra_config.{key}" in str(err.value.field or err.value)


def test_rank_places() -> None:
    """Each TP rank needs its own places: ``{rank}`` is replaced per rank, and the places
    that lack it are the ones ranks would share (a size alone is a pool in the process)."""
    spec = StoreSpec.parse({"dram": "64MiB", "nvme": "1GiB@/var/tmp/kv-{rank}.img"})
    assert spec.unranked_places() == []
    assert spec.for_rank(3).nvme is not None
    assert spec.for_rank(3).nvme.place == "/var/tmp/kv-3.img"
    shared = StoreSpec.parse({"dram": "64MiB@/dev/shm/pool", "nvme": "1GiB@/var/tmp/kv.img"})
    assert shared.unranked_places() == ["/dev/shm/pool", "/var/tmp/kv.img"]
