"""The generated admin sweep (emulator.nvmetcp.conformance.sweep) against four targets.

* kvtool's target, Linux nvmet in the 6.1 and the 6.12 guest, and SPDK's nvmf_tgt each
  answer every probe exactly as fixtures/conformance/sweep.json recorded: a target that
  starts or stops answering something fails its test (``KVTOOL_SWEEP_RECORD=1`` rewrites
  that target's column instead, for a deliberate change).
* The recorded table follows the rule: wherever kvtool answers differently from a
  reference, ``SWEEP_REASONS`` says why, and it names nothing else; docs/nvme-tcp.md
  carries exactly the table the fixture gives.
* Host tools as clients: ``spdk_nvme_identify`` prints no failure against kvtool's target
  that it does not print against SPDK's, and its controller's error log stays empty; in
  each guest, nvme-cli's id-ctrl, id-ns, get-feature (every FID), smart-log and error-log
  fail against kvtool's target only where they fail against the kernel's own nvmet, and
  their normal use adds nothing to the error log.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from emulator.nvmetcp import Target as KvtoolTarget
from emulator.nvmetcp import simple_config
from emulator.nvmetcp.conformance import Target
from emulator.nvmetcp.conformance.reasons import SWEEP_REASONS
from emulator.nvmetcp.conformance.sweep import (
    REFERENCES,
    TARGETS,
    differences,
    dump,
    from_json,
    markdown,
    run_sweep,
    to_json,
)
from emulator.qemu.build import BuildError, ensure_built
from emulator.qemu.guest import DEFAULT_NQN, Guest
from emulator.spdk import tools
from kvtool.target.spdk.app import SpdkApp
from kvtool.target.spdk.install import SpdkInstall
from tests.conftest import free_port
from tests.helpers.guest_nvme import host_tool_runs
from tests.helpers.qemu_guest import start_guest

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "fixtures" / "conformance" / "sweep.json"
DOC = REPO / "docs" / "nvme-tcp.md"
BEGIN, END = "<!-- sweep-table begin -->", "<!-- sweep-table end -->"
NQN = DEFAULT_NQN  # every target serves the same name


def recorded() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(FIXTURE.read_text())
    assert doc["schema"] == "kvtool.sweep/1"
    return doc


def recorded_table() -> dict[str, dict[str, Any]]:
    return {name: from_json(col) for name, col in recorded()["targets"].items()}


def check_column(name: str, t: Target) -> None:
    """Sweep ``t`` and compare with the recorded column ``name`` (or record it)."""
    got = run_sweep(t)
    assert not [k for k, v in got.items() if v.kind == "error"], got
    if os.environ.get("KVTOOL_SWEEP_RECORD"):
        targets = recorded()["targets"]
        targets[name] = to_json(got)
        FIXTURE.write_text(dump({k: targets[k] for k in TARGETS if k in targets}))
        return
    want = recorded_table()[name]
    changed = {k: (want[k].text() if k in want else None, v.text())
               for k, v in got.items() if k not in want or want[k].key() != v.key()}
    assert set(got) == set(want), "the probes changed: record the sweep again"
    assert not changed, f"{name} answers differently from the recorded sweep: {changed}"


# --- kvtool's target and the recorded table ---------------------------------------------------


@pytest.fixture(scope="module")
def kvtool_target() -> Iterator[KvtoolTarget]:
    cfg = simple_config(nqn=NQN, backing="64MiB", allow_any_host=True,
                        listen=["127.0.0.1:0"])
    with KvtoolTarget(cfg) as t:
        yield t


@pytest.mark.integration
def test_kvtool_matches_the_recorded_sweep(kvtool_target: KvtoolTarget) -> None:
    check_column("kvtool", Target("127.0.0.1", kvtool_target.port, NQN))


def test_recorded_table_follows_the_rule_and_is_in_the_docs() -> None:
    table = recorded_table()
    assert set(table) == set(TARGETS), "record every target's column"
    labels = list(table["kvtool"])
    for name in REFERENCES:
        assert list(table[name]) == labels, name
    differs = differences(table)
    assert set(differs) == set(SWEEP_REASONS), {
        k: {t: table[t][k].text() for t in TARGETS} for k in set(differs) ^ set(SWEEP_REASONS)}
    text = DOC.read_text()
    doc = text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip()
    want = markdown(table, SWEEP_REASONS)
    assert doc == want, "docs/nvme-tcp.md's sweep table is stale; paste:\n" + want


@pytest.mark.integration
def test_cli_sweeps_one_target_and_refuses_bad_input(kvtool_target: KvtoolTarget) -> None:
    cmd = [sys.executable, "-m", "emulator.nvmetcp.conformance.sweep"]
    done = subprocess.run([*cmd, f"127.0.0.1:{kvtool_target.port}", NQN, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["results"]["Get Features 01h Arbitration"] == {
        "status": "SUCCESS", "facts": {"dw0": "0x0"}}
    bad = subprocess.run([*cmd, "nowhere", NQN], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "HOST:PORT" in bad.stderr


def test_the_mandatory_features_answer() -> None:
    """Issue 25: Arbitration, Power Management and Temperature Threshold (what
    spdk_nvme_identify reads), and the other features a fabrics I/O controller must
    have, succeed on kvtool's target."""
    kv = recorded_table()["kvtool"]
    for fid in ("01h", "02h", "04h", "05h", "06h", "07h", "0Ah", "0Bh", "0Fh"):
        got = [v for k, v in kv.items() if k.startswith(f"Get Features {fid} ")]
        assert len(got) == 1 and got[0].status == "SUCCESS", (fid, got)
        got = [v for k, v in kv.items() if k.startswith(f"Set Features {fid} ")]
        assert len(got) == 1 and got[0].status == "SUCCESS", (fid, got)


# --- Linux nvmet in the guests ----------------------------------------------------------------


@pytest.fixture(scope="module", params=["6.1", "6.12"])
def linux_guest(request: pytest.FixtureRequest,
                kvtool_target: KvtoolTarget) -> Iterator[tuple[str, Guest]]:
    """A guest of each kernel serving nvmet on NQN; it reaches kvtool's target too."""
    kernel = request.param
    try:
        image = ensure_built(kernel=kernel)
    except BuildError as e:
        if os.environ.get("CI"):
            pytest.fail(f"the {kernel} QEMU guest image cannot be built in CI: {e}")
        pytest.skip(f"the {kernel} QEMU guest image cannot be built here: {e}")
    guest = start_guest(Guest(image, target=True, nqn=NQN, size_mb=64,
                              guest_forwards=[kvtool_target.port]))
    try:
        yield kernel, guest
    finally:
        guest.stop()


@pytest.mark.qemu
@pytest.mark.integration
@pytest.mark.slow
def test_linux_nvmet_matches_the_recorded_sweep(linux_guest: tuple[str, Guest]) -> None:
    kernel, guest = linux_guest
    check_column(f"linux-{kernel}", Target("127.0.0.1", guest.target_port, NQN))


@pytest.mark.qemu
@pytest.mark.integration
@pytest.mark.slow
def test_nvme_cli_fails_against_kvtool_only_where_it_fails_against_nvmet(
        linux_guest: tuple[str, Guest], kvtool_target: KvtoolTarget) -> None:
    _kernel, guest = linux_guest
    nvmet = host_tool_runs(guest, "127.0.0.1", 4420, NQN)  # the guest's own target
    ours = host_tool_runs(guest, None, kvtool_target.port, NQN)
    assert list(ours.runs) == list(nvmet.runs)
    extra = {cmd: ours.runs[cmd][1][-300:] for cmd in ours.runs
             if ours.runs[cmd][0] != 0 and nvmet.runs[cmd][0] == 0}
    assert not extra, extra
    for cmd in ("id-ctrl", "id-ns", "smart-log", "error-log", "get-feature -f 0x1",
                "get-feature -f 0x2", "get-feature -f 0x4", "get-feature -f 0x7"):
        assert ours.runs[cmd][0] == 0, (cmd, ours.runs[cmd][1][-300:])
    assert ours.errors_before == ours.errors_after, "normal use added error log entries"


# --- SPDK's nvmf_tgt --------------------------------------------------------------------------


def spdk_subsystem(app: SpdkApp) -> int:
    """NQN on ``app``: a 64 MiB malloc namespace 1, any host, a fresh 127.0.0.1 port."""
    port = free_port()
    app.rpc("nvmf_create_transport", {"trtype": "TCP"})
    app.rpc("bdev_malloc_create", {"name": "Sweep", "num_blocks": 131072, "block_size": 512})
    app.rpc("nvmf_create_subsystem", {"nqn": NQN, "allow_any_host": True})
    app.rpc("nvmf_subsystem_add_ns", {"nqn": NQN, "namespace": {"bdev_name": "Sweep"}})
    app.rpc("nvmf_subsystem_add_listener", {"nqn": NQN, "listen_address": {
        "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": str(port)}})
    return port


def test_spdk_matches_the_recorded_sweep(spdk_app: Any) -> None:
    port = spdk_subsystem(spdk_app("nvmf_tgt"))
    check_column("spdk", Target("127.0.0.1", port, NQN))


_FAILED = re.compile(r"^.*\bfailed\b.*$", re.M)
_LIFETIME_ERRORS = re.compile(r"^Lifetime Error Log Entries:\s+(\d+)", re.M)


def identify_failures(out: str) -> tuple[set[str], int, int]:
    """The "... failed" lines, the error log entries printed, the lifetime error count."""
    errors = out[out.index("Error Log\n=========\n"):] if "Error Log\n=====" in out else ""
    errors = errors.split("\n\n", 1)[0]
    lifetime = _LIFETIME_ERRORS.search(out)
    return (set(_FAILED.findall(out)), errors.count("\nEntry: "),
            int(lifetime.group(1)) if lifetime else -1)


def test_spdk_nvme_identify_against_kvtool_prints_what_it_prints_against_spdk(
        spdk: SpdkInstall, spdk_app: Any, kvtool_target: KvtoolTarget) -> None:
    port = spdk_subsystem(spdk_app("nvmf_tgt"))
    theirs = tools.identify(spdk, tools.trid("127.0.0.1", port, NQN))
    ours = tools.identify(spdk, tools.trid("127.0.0.1", kvtool_target.port, NQN))
    assert theirs.ok and ours.ok, (theirs.output[-1500:], ours.output[-1500:])
    failed, entries, lifetime = identify_failures(ours.output)
    ref_failed, _ref_entries, _ref_lifetime = identify_failures(theirs.output)
    assert failed <= ref_failed, failed - ref_failed
    assert (entries, lifetime) == (0, 0), ours.output[ours.output.find("Error Log"):][:1500]
