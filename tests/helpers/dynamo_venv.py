"""NVIDIA Dynamo 1.6.1 in a virtualenv of its own, cached under /var/tmp: what a benchmark
or a test needs to run Dynamo's offline replay (``dynamo.replay.run_trace_replay``: mocker
engines, the default KV router, Rust, a virtual clock) beside kvtool.

``pip install ai-dynamo`` fails here (a dependency it declares comes from a host this
machine cannot reach), but the two wheels install alone, and the offline replay imports
only ``typing_extensions`` beyond them (the rest of ai-dynamo's declared dependencies are
its serving stack's)::

    pip download --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    python -m venv V && V/bin/pip install --no-deps ai_dynamo_runtime-*.whl ai_dynamo-*.whl
    V/bin/pip install typing_extensions

:func:`dynamo_python` does that once per machine: the virtualenv lives in
``/var/tmp/kvtool-dynamo-1.6.1-<key>`` (``KVTOOL_DYNAMO_CACHE`` moves the parent), the key
a hash of the pins, the extra and this Python's version; it is built behind an flock on
``<dir>/.lock`` (parallel sessions and tests wait for one build, then share it) and marked
ready by ``<dir>/.ready``. It returns the virtualenv's Python, or a one-line reason when it
cannot be made (no registry, a failed install), which a test skips with and a benchmark
prints. The directory layout and key are those of ``tests/helpers/dynamo_oracle.py`` (issue
38's routing oracle), so both share one cache.

    python -m tests.helpers.dynamo_venv      # build (or find) it; print its Python

:func:`run_replay` runs one replay there in a subprocess and returns its summary; the
environment quiets Dynamo's logging (``DYN_LOG=error``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PINS = ("ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1")
EXTRA = ("typing_extensions",)
"""What ``dynamo.replay`` imports beyond the two wheels."""
CACHE_ROOT = Path(os.environ.get("KVTOOL_DYNAMO_CACHE", "/var/tmp"))
QUIET = {"DYN_LOG": "error", "DYNAMO_SKIP_PYTHON_LOG_INIT": "1"}
"""Environment that keeps Dynamo's Rust and Python logging to errors."""


def venv_dir() -> Path:
    """Where the virtualenv is cached (keyed by the pins, the extra and Python's version)."""
    key = hashlib.sha256("\n".join((*PINS, *EXTRA, sys.version.split()[0])).encode()
                         ).hexdigest()[:12]
    return CACHE_ROOT / f"kvtool-dynamo-1.6.1-{key}"


def _imports(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", "import dynamo.replay, dynamo._core"],
                           capture_output=True, text=True, timeout=300, check=False)
    return probe.returncode == 0


def _tail(out: subprocess.CompletedProcess[str]) -> str:
    return " | ".join((out.stderr or out.stdout).strip().splitlines()[-3:])


def dynamo_python() -> Path | str:
    """The cached virtualenv's Python, made on first use; a string says why it could not be."""
    root = venv_dir()
    python = root / "venv" / "bin" / "python"
    stamp = root / ".ready"
    if stamp.exists() and python.exists():
        return python
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {root}: {exc}"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and _imports(python):
            return python  # another process built it while this one waited
        shutil.rmtree(root / "venv", ignore_errors=True)
        wheels = root / "wheels"
        wheels.mkdir(exist_ok=True)
        for cmd in ([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                     str(wheels), *PINS],
                    [sys.executable, "-m", "venv", str(root / "venv")]):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
            if out.returncode != 0:
                return f"{' '.join(cmd[:4])} … failed: {_tail(out)}"
        whl = sorted(str(p) for p in wheels.glob("*.whl"))
        out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *whl],
                             capture_output=True, text=True, timeout=900, check=False)
        if out.returncode == 0:
            out = subprocess.run([str(python), "-m", "pip", "install", "-q", *EXTRA],
                                 capture_output=True, text=True, timeout=900, check=False)
        if out.returncode != 0 or not _imports(python):
            return ("installing Dynamo's wheels failed: "
                    f"{_tail(out) or 'dynamo.replay does not import'}")
        stamp.write_text("\n".join(PINS) + "\n")
    return python


REPLAY = r"""
import json, sys, time
t0 = time.perf_counter()
from dynamo.replay import run_trace_replay
a = json.loads(sys.argv[1])
r = run_trace_replay(a["trace"], num_workers=a["workers"], router_mode=a["router"],
                     trace_block_size=a["block_tokens"],
                     extra_engine_args={"engine": {"block_size": a["block_tokens"],
                                                   "num_gpu_blocks": a["blocks"]}})
s = {k: v for k, v in r.summary.items() if isinstance(v, (int, float, str))}
s["process_s"] = time.perf_counter() - t0
print(json.dumps(s))
"""
"""One offline replay of a Mooncake trace at its timestamps (argv[1]: JSON of ``trace``,
``workers``, ``router`` (``kv_router`` or ``round_robin``), ``block_tokens``, ``blocks``);
prints the report's summary as one JSON line."""


def replay_command(python: Path, trace: Path | str, *, workers: int, blocks: int,
                   block_tokens: int, router: str = "kv_router") -> list[str]:
    """The command line of one Dynamo replay (whole process: ``python -c`` :data:`REPLAY`)."""
    args = {"trace": str(trace), "workers": workers, "blocks": blocks,
            "block_tokens": block_tokens, "router": router}
    return [str(python), "-c", REPLAY, json.dumps(args)]


def run_replay(python: Path, trace: Path | str, **kw: Any) -> dict[str, Any]:
    """Run :func:`replay_command` and return Dynamo's summary."""
    with tempfile.TemporaryDirectory(prefix="kvtool-dynamo-") as tmp:
        out = subprocess.run(replay_command(python, trace, **kw), capture_output=True,
                             text=True, timeout=1800, cwd=tmp, env={**os.environ, **QUIET},
                             check=False)
    if out.returncode != 0:
        raise RuntimeError(f"Dynamo's replay failed: {_tail(out)}")
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return summary


if __name__ == "__main__":
    found = dynamo_python()
    print(found)
    sys.exit(0 if isinstance(found, Path) else 1)
