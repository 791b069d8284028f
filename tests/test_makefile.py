"""The Makefile's targets: each declared one has a rule, and ``make bench`` times kvtool as
users install it. Dry runs (``make -n``) only: they print the commands, run none."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-n", "-C", str(REPO), *args], capture_output=True,
                          text=True, timeout=60)


def phony_targets() -> list[str]:
    text = (REPO / "Makefile").read_text()
    found = re.search(r"^\.PHONY:(.*)$", text, re.MULTILINE)
    assert found, "the Makefile declares its phony targets"
    return found.group(1).split()


@pytest.mark.parametrize("target", phony_targets())
def test_every_declared_target_has_a_rule(target: str) -> None:
    """A phony target without a rule is "nothing to be done" for make, exit 0."""
    text = (REPO / "Makefile").read_text()
    assert re.search(rf"^{re.escape(target)}:", text, re.MULTILINE), f"no rule for {target}"
    done = dry_run(target, "VENV=/nonexistent/venv", "BENCH_VENV=/nonexistent/bench")
    assert done.returncode == 0, done.stderr
    assert "Nothing to be done" not in done.stdout


def test_bench_uses_a_runtime_only_virtualenv() -> None:
    """``make bench`` installs kvtool without extras, and not editable, into its own
    virtualenv, as ``pip install kvtool`` does (BENCHMARKS.md: the test extras add modules
    that msgspec imports at start-up, and an editable install's import hook loads more
    into every process), and runs the replay benchmarks with that interpreter on this
    tree's code (its root on PYTHONPATH, ahead of the installed copy)."""
    done = dry_run("bench", "BENCH_VENV=/nonexistent/bench")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    installs = [line for line in lines if "pip install" in line and "--upgrade" not in line]
    assert installs == ["/nonexistent/bench/bin/python -m pip install -q ."]
    prefix = f"PYTHONPATH={REPO} /nonexistent/bench/bin/python bench/"
    runs = [line.split()[2] for line in lines if line.startswith(prefix)]
    assert runs == ["bench/replay_speed.py", "bench/replay_speed.py", "bench/replay_memory.py",
                    "bench/serving_speed.py"]
    for script in runs:
        assert (REPO / script).is_file()
