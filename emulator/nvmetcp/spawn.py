"""Run the emulator's NVMe/TCP target as a child process for as long as a ``with`` lasts.

``python -m emulator.nvmetcp ARGS --ready-file F`` is started, F is waited for (the
target writes it, atomically, once it listens), and the process is stopped (SIGTERM, then
SIGKILL) when the block ends, also after an error. For experiments, benchmarks and tests
that need a target of their own on a free port (``--listen 127.0.0.1:0``); ``kvtool target
up`` starts the same process in the background and records it instead
(kvtool/target/emulator.py).

    with spawned(["--listen", "127.0.0.1:0", "--nqn", NQN, "--backing", "64MiB",
                  "--allow-any-host"], workdir=tmp) as t:
        url = t.url()  # nvme+tcp://127.0.0.1:PORT/NQN/1
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # where ``-m emulator.nvmetcp`` resolves


class TargetStartError(RuntimeError):
    """The target exited, or did not report ready in time (the message has its log's tail)."""


@dataclass(frozen=True)
class SpawnedTarget:
    proc: subprocess.Popen[bytes]
    ready: dict[str, Any]  # the ready record: pid, urls, listen, discovery, metrics
    log: Path

    @property
    def port(self) -> int:
        """The port of the first listener."""
        return int(self.ready["listen"][0].rsplit(":", 1)[1])

    def url(self, nsid: int = 1) -> str:
        """The first subsystem's namespace ``nsid`` on the first listener."""
        return f"{self.ready['urls'][0]}/{nsid}"

    def log_tail(self, lines: int = 5) -> str:
        """The end of its output so far (the log is removed with the target)."""
        return _tail(self.log, lines)


@contextlib.contextmanager
def spawned(args: Sequence[str], *, workdir: Path, python: str = sys.executable,
            env: Mapping[str, str] | None = None,
            timeout: float = 30.0) -> Iterator[SpawnedTarget]:
    """Start the target with ``args`` (its options, without ``--ready-file``); yield it once
    it is ready; stop it when the block ends. Its output goes to a log in ``workdir``,
    removed with its ready file when it stops (a failed start's error quotes its tail)."""
    workdir = workdir.absolute()  # the child runs in the repository (``-m`` resolves there)
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"target-{uuid.uuid4().hex[:8]}"
    ready, log = workdir / f"{name}.ready", workdir / f"{name}.log"
    argv = [python, "-m", "emulator.nvmetcp", *args, "--ready-file", str(ready)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                cwd=REPO, env=dict(env) if env is not None else None)
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None:
                raise TargetStartError(f"the target exited with status {proc.returncode}: "
                                       f"{_tail(log)}")
            if time.monotonic() > deadline:
                raise TargetStartError(f"the target did not report ready within "
                                       f"{timeout:.0f} s: {_tail(log)}")
            time.sleep(0.05)
        yield SpawnedTarget(proc, json.loads(ready.read_text()), log)
    finally:
        stop(proc)
        ready.unlink(missing_ok=True)
        log.unlink(missing_ok=True)


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM (the target flushes its backing files and exits), SIGKILL after ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path, lines: int = 5) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"
