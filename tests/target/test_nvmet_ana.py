"""ANA on the nvmet backend against the simulated configfs (tests/helpers/fake_nvmet.py):
``ana_grpid`` per namespace, ``ports/N/ana_groups/G/ana_state`` per listener, run-time
changes, status, and a down that removes the groups it made (else the port's rmdir fails).
The same code runs on the guest kernel's real configfs in tests/target/test_qemu_ana.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# imported before pyfakefs is up (see tests/target/test_nvmet.py)
import kvtool.target.emulator  # noqa: F401
from kvtool.target.config import TargetConfig
from kvtool.target.loader import parse_config
from kvtool.target.nvmet.backend import NvmetBackend
from kvtool.target.plan import apply
from tests.helpers.fake_nvmet import ROOT, FakeNvmetKernel, snapshot

H1 = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-4111-8111-111111111111"
S1 = "nqn.2026-01.io.kvtool:ana"


def config(state2: str = "non-optimized", group2: int = 2) -> TargetConfig:
    return parse_config(f"""
backend = "nvmet"
name = "ana"
[[subsystem]]
nqn = "{S1}"
hosts = ["{H1}"]
  [[subsystem.namespace]]
  nsid = 1
  path = "/data/ns1.img"
  [[subsystem.namespace]]
  nsid = 2
  path = "/data/ns2.img"
  ana_group = {group2}
[[listener]]
id = 1
address = "127.0.0.1"
port = 4420
ana = {{ 2 = "optimized" }}
[[listener]]
id = 2
address = "127.0.0.1"
port = 4421
ana = {{ 1 = "inaccessible", 2 = "{state2}" }}
""", source="ana.toml")


@pytest.fixture
def backend(fs: object) -> Iterator[NvmetBackend]:
    os.makedirs("/data")
    for name in ("ns1.img", "ns2.img"):
        with open(f"/data/{name}", "wb") as f:
            f.truncate(16 << 20)
    yield NvmetBackend(cfs=FakeNvmetKernel(), manage_modules=False)


def test_up_sets_groups_and_states_and_down_removes_them(backend: NvmetBackend) -> None:
    cfg = config()
    apply(backend.plan_up(cfg))
    tree = {k: v.strip() for k, v in snapshot().items()}
    assert tree["subsystems/" + S1 + "/namespaces/1/ana_grpid"] == "1"
    assert tree["subsystems/" + S1 + "/namespaces/2/ana_grpid"] == "2"
    assert (tree["ports/1/ana_groups/1/ana_state"], tree["ports/1/ana_groups/2/ana_state"]) \
        == ("optimized", "optimized")  # a made group starts inaccessible: up set it
    assert (tree["ports/2/ana_groups/1/ana_state"], tree["ports/2/ana_groups/2/ana_state"]) \
        == ("inaccessible", "non-optimized")
    assert backend.plan_up(cfg, cfg).empty  # idempotent on the live tree
    status = backend.status(cfg)
    assert {x["id"]: x["ana"] for x in status["subsystems"][0]["listeners"]} == {
        1: {"1": "optimized", "2": "optimized"}, 2: {"1": "inaccessible", "2": "non-optimized"}}
    # a changed state, then a namespace moved to another group: updated in place
    flipped = config(state2="inaccessible")
    plan = backend.plan_up(flipped, cfg)
    assert [(s.action, s.target, s.detail) for s in plan.steps] == [
        ("update", "ports/2/ana_groups/2/ana_state", "non-optimized -> inaccessible")]
    apply(plan)
    changed = config(state2="inaccessible", group2=1)
    plan = backend.plan_up(changed, flipped)
    assert [(s.action, s.target, s.detail) for s in plan.steps] == [
        ("update", f"subsystems/{S1}/namespaces/2/ana_grpid", "2 -> 1")]
    apply(plan)
    # at run time (kvtool target ana)
    backend.set_ana(changed, changed.listeners[0], 1, "non-optimized")
    assert snapshot()["ports/1/ana_groups/1/ana_state"].strip() == "non-optimized"
    apply(backend.plan_down(changed))
    assert not any(k.startswith(("ports/", "subsystems/")) for k in snapshot())
    assert not os.path.exists(f"{ROOT}/ports/1")


def test_a_config_without_ana_leaves_the_kernel_defaults(backend: NvmetBackend) -> None:
    cfg = parse_config(f"""
backend = "nvmet"
name = "plain"
[[subsystem]]
nqn = "{S1}"
allow_any_host = true
  [[subsystem.namespace]]
  nsid = 1
  path = "/data/ns1.img"
[[listener]]
id = 1
address = "127.0.0.1"
port = 4420
""", source="plain.toml")
    plan = backend.plan_up(cfg)
    assert not [s for s in plan.steps if "/ana_" in s.target]
    apply(plan)
    assert "ana" not in backend.status(cfg)["subsystems"][0]["listeners"][0]
