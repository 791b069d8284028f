"""FX100-style parallel read: real chunks through real engines (O_DIRECT file, loop
device, kvtool's NVMe/TCP target), small sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.experiments import find_experiment, run_experiment
from kvtool.experiments.parallel_read import measure_target
from kvtool.experiments.spec import load_experiment
from tests.conftest import is_root

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("kind", ["file", "nvme-tcp", "loop"])
def test_measure_target(kind: str, store_dir: Path) -> None:
    if kind == "loop" and not is_root():
        pytest.skip("loop devices need root")
    r = measure_target(kind, store_dir, requests=4, per_request=3, chunk_bytes=64 * 1024 + 512,
                       serial_qd=1, parallel_qd=8)
    for mode, qd in (("serial", 1), ("parallel", 8)):
        row = r[mode]
        assert row["qd"] == qd and row["chunks"] == 12 and row["bytes"] == 12 * (64 * 1024 + 512)
        assert row["gbps"] > 0 and 0 < row["ttft_s"] <= row["ttft_max_s"] <= row["seconds"]
    assert not list(store_dir.iterdir())  # scratch files and devices are cleaned up


def test_experiment_rows_measured(store_dir: Path, tmp_path: Path) -> None:
    src = find_experiment("fx100-parallel-read").path
    assert src is not None
    small = tmp_path / "fx100-parallel-read.toml"
    small.write_text(src.read_text().replace("chunk_bytes = 4194304", "chunk_bytes = 65536")
                     .replace('targets = ["file", "loop", "nvme-tcp"]',
                              'targets = ["file", "nvme-tcp"]'))
    doc = run_experiment(load_experiment(small), out_dir=tmp_path / "out", scratch=store_dir)
    assert doc["mode"] == "measure" and set(doc["reads"]) == {"file", "nvme-tcp"}
    rows = {r["claim"]: r for r in doc["rows"]}
    assert rows["O_DIRECT file: in parallel"]["measured"] is True
    assert rows["O_DIRECT file: in parallel"]["kvtool"] > 0
    # A target the run did not measure is a row that says so, not a crash.
    assert rows["loop device: parallel / serial bandwidth"]["kvtool"] is None
    assert (tmp_path / "out" / "fx100-parallel-read.png").exists()
