"""The differential conformance harness (emulator.nvmetcp.conformance).

* Against the real Linux nvmet-tcp target in the QEMU guest and kvtool's target in the same
  run (one guest boot for the module): every case answers the same on both, except the
  divergences the harness names with their reason; and docs/nvme-tcp.md carries exactly the
  table this run produced.
* Without the guest: kvtool's target alone, checked against the Linux column recorded in
  docs/nvme-tcp.md for every case that should agree; the CLI's exit status and errors.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.nvmetcp import Target as KvtoolTarget
from emulator.nvmetcp import simple_config
from emulator.nvmetcp.conformance import REASONS, Target, markdown, run_all
from tests.helpers.qemu_guest import KernelTarget

DOC = Path(__file__).resolve().parents[2] / "docs" / "nvme-tcp.md"
BEGIN, END = "<!-- conformance-table begin -->", "<!-- conformance-table end -->"
NQN = "nqn.2024-01.io.kvtool:emu"  # the guest's, so both targets serve the same name


@pytest.fixture(scope="module")
def kvtool_target() -> Iterator[KvtoolTarget]:
    cfg = simple_config(nqn=NQN, backing="64MiB", allow_any_host=True,
                        listen=["127.0.0.1:0"])
    with KvtoolTarget(cfg) as t:
        yield t


def doc_table() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip()


def doc_rows() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in doc_table().splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0]] = (cells[1], cells[2], cells[3])
    return rows


@pytest.mark.integration
def test_kvtool_target_matches_the_recorded_linux_column(kvtool_target: KvtoolTarget) -> None:
    results = run_all(Target("127.0.0.1", kvtool_target.port, NQN))
    rows = doc_rows()
    assert set(rows) == set(results), "docs/nvme-tcp.md's table lists other cases"
    for label, got in results.items():
        assert got.kind not in ("error", "no answer"), (label, got.text())
        linux, recorded, why = rows[label]
        assert got.text() == recorded, label
        if why != "same":
            assert why == REASONS[label]
        elif got.kind != "closed":  # closes may differ in the TermReq only
            assert got.text() == linux, label


@pytest.mark.integration
def test_cli_runs_one_target_and_refuses_bad_input(kvtool_target: KvtoolTarget) -> None:
    cmd = [sys.executable, "-m", "emulator.nvmetcp.conformance"]
    done = subprocess.run([*cmd, f"127.0.0.1:{kvtool_target.port}", NQN, "--only", "SGL"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "SGL: Property Get CAP, all-zero SGL (Data Block, Address, length 0): SUCCESS" \
        in done.stdout
    bad = subprocess.run([*cmd, "nowhere", NQN], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "HOST:PORT" in bad.stderr


def test_harness_against_linux_nvmet_and_kvtool(kernel_target: KernelTarget,
                                                 kvtool_target: KvtoolTarget) -> None:
    linux = run_all(Target(kernel_target.host, kernel_target.port, kernel_target.subnqn))
    ours = run_all(Target("127.0.0.1", kvtool_target.port, NQN))
    errors = {k: v.text() for k, v in {**linux, **ours}.items() if v.kind == "error"}
    assert not errors
    differs = {k for k in ours if ours[k].key() != linux[k].key()}
    assert differs == set(REASONS), {k: (linux[k].text(), ours[k].text())
                                     for k in differs ^ set(REASONS)}
    table = markdown(ours, linux)
    assert table == doc_table(), "docs/nvme-tcp.md's table is stale; paste:\n" + table
