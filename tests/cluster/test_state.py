"""The cluster state record read back (no root): through the one config reader (issue 39),
so a damaged record is one line FILE:LINE: field 'F': …, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.cluster.state import (
    ClusterState,
    ClusterTarget,
    NodeState,
    Resource,
    cluster_name,
    load_state,
)
from kvtool.errors import InputError
from tests.conftest import run


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def _state() -> ClusterState:
    return ClusterState(
        name="mini", file="mini.toml", phase="up", nodes=[NodeState("n0", "kv-n0", "10.0.0.2",
                                                                   ["head", "engine"])],
        targets=[ClusterTarget("t0", "n0", "nvme+tcp://10.0.0.2:4420/nqn.x", "nqn.x", "nqn.h",
                               "/k", size=1 << 20)],
        resources=[Resource("netns", "kv-n0")])


def _write_edited(path: Path, old: str, new: str) -> list[str]:
    lines = json.dumps(_state().to_json(), indent=2).splitlines()
    (i,) = [i for i, line in enumerate(lines) if old in line]
    lines[i] = lines[i].replace(old, new)
    path.write_text("\n".join(lines) + "\n")
    return lines


def test_round_trip(state_dir: Path) -> None:
    state = _state()
    state.save()
    assert load_state("mini") == state
    assert load_state("absent") is None


def test_an_older_records_engine_key_still_reads(state_dir: Path) -> None:
    state = _state()
    path = state.save()
    doc = json.loads(path.read_text())
    doc["targets"][0]["engine"] = doc["targets"][0].pop("runtime")
    path.write_text(json.dumps(doc))
    loaded = load_state("mini")
    assert loaded is not None and loaded.targets[0].runtime == "userspace"


@pytest.mark.parametrize(("old", "new", "field", "words"), [
    ('"address": "10.0.0.2"', '"address": 10', "nodes[0].address", "expected a string"),
    ('"size": 1048576', '"size": "big"', "targets[0].size", "expected an integer"),
    ('"phase": "up"', '"phaze": "up"', "phaze", "unknown key 'phaze'"),
    ('"name": "kv-n0"', '"name": "kv-n0", "colour": 1', "resources[0].colour",
     "unknown key 'colour'"),
])
def test_a_bad_field_names_file_line_and_field(state_dir: Path, old: str, new: str,
                                               field: str, words: str) -> None:
    path = state_dir / "clusters" / "mini.json"
    path.parent.mkdir(parents=True)
    lines = _write_edited(path, old, new)
    line = 1 + next(i for i, text in enumerate(lines) if new in text)
    with pytest.raises(InputError) as info:
        load_state("mini")
    assert (info.value.file, info.value.line, info.value.field) == (str(path), line, field)
    assert words in info.value.message
    result = run("cluster", "status", "mini")
    assert result.exit_code == 2
    (err,) = result.stderr.strip().splitlines()
    assert err.startswith(f"kvtool: error: {path}:{line}: field '{field}': "), err


def test_a_missing_field_is_named(state_dir: Path) -> None:
    path = state_dir / "clusters" / "mini.json"
    path.parent.mkdir(parents=True)
    doc = _state().to_json()
    del doc["nodes"][0]["address"]
    path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(InputError, match="missing required key 'address'") as info:
        load_state("mini")
    assert info.value.field == "nodes[0].address" and info.value.line is not None


def test_cluster_name_reads_the_cluster_file_through_the_one_reader(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('name = "lab"\n')
    assert cluster_name(p) == "lab"
    p.write_text("[[engine]]\n")
    assert cluster_name(p) == "c"
    p.write_text("[[engine]]\nname = 3\nname = 4\n")
    with pytest.raises(InputError) as info:
        cluster_name(p)
    assert str(info.value).startswith(f"{p}:3: invalid TOML")
    p.write_text("name = 3\n")
    with pytest.raises(InputError) as info:
        cluster_name(p)
    assert str(info.value) == f"{p}:1: field 'name': expected a string, got int 3"
