"""Find SPDK's NVMe-oF target and host tools, building them once from the vendored sources.

Where SPDK comes from, in order:

1. ``$KVTOOL_SPDK_DIR``: an SPDK tree built elsewhere (``build/bin/nvmf_tgt`` and
   ``scripts/rpc.py`` under it);
2. ``emulator/spdk/build.sh`` (adapted from ``../shared/reference/spdk/build.sh``), which builds
   SPDK v26.05 with DPDK v26.03 from the tarballs in ``../shared/vendor/spdk``, with the RDMA
   transport and for x86-64-v2 (so that it also runs in the QEMU guest), into
   ``$KVTOOL_SPDK_CACHE/<hash of the tarballs and the script>`` (default
   ``/var/tmp/kvtool-spdk``; about 4-8 minutes on 2 cores the first time; instant afterwards).
   Debian's libdpdk-dev cannot be used: SPDK refuses it at run time. The script apt-installs
   what it needs (rdma-core's libibverbs/librdmacm and the rxe provider among them).

An flock serializes builders, since the script starts by deleting a half-built tree.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared"
BUILD_SCRIPT = REPO / "emulator" / "spdk" / "build.sh"
VENDOR = SHARED / "vendor" / "spdk"
DEFAULT_CACHE = Path("/var/tmp/kvtool-spdk")


def cache_dir() -> Path:
    return Path(os.environ.get("KVTOOL_SPDK_CACHE") or DEFAULT_CACHE)
# SPDK's applications and scripts run with Debian's PATH, not a virtualenv's: the build
# and scripts/rpc.py expect Debian's python3 and its modules.
SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGKILL when its parent dies (PR_SET_PDEATHSIG), so an
    interrupted test run leaves no busy-polling SPDK process behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class SpdkNotFound(RuntimeError):
    """No SPDK here and none can be built; the message says why and what to do."""


@dataclass(frozen=True)
class SpdkInstall:
    """An SPDK tree with its applications built (``build/bin``)."""

    root: Path

    def bin(self, name: str) -> Path:
        return self.root / "build" / "bin" / name

    @property
    def rpc_py(self) -> Path:
        return self.root / "scripts" / "rpc.py"

    def version(self) -> dict[str, object]:
        """What ``spdk_get_version`` would answer, read from ``nvmf_tgt --version``."""
        out = subprocess.run([str(self.bin("nvmf_tgt")), "--version"], capture_output=True,
                             text=True, env=self.env(), timeout=30, check=False)
        m = re.search(r"SPDK v(\d+)\.(\d+)(?:\.(\d+))?(\S*)", out.stdout + out.stderr)
        if m is None:
            raise SpdkNotFound(f"{self.bin('nvmf_tgt')} --version printed no SPDK version")
        return {"version": m.group(0), "fields": {
            "major": int(m.group(1)), "minor": int(m.group(2)), "patch": int(m.group(3) or 0),
            "suffix": m.group(4)}}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
        env["PATH"] = SYSTEM_PATH
        return env


def _usable(root: Path) -> bool:
    return (root / "build" / "bin" / "nvmf_tgt").is_file()


def build_dir() -> Path:
    """Where build.sh puts (or has put) SPDK for the vendored tarballs."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), str(cache_dir()), "--print-dir"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def find_spdk(build: bool = False, log: Callable[[str], None] | None = None) -> SpdkInstall:
    """The SPDK to use. With ``build``, run build.sh when the vendored sources are not built
    yet (minutes); without, say how to build it."""
    env_dir = os.environ.get("KVTOOL_SPDK_DIR")
    if env_dir:
        root = Path(env_dir)
        if not _usable(root):
            raise SpdkNotFound(f"KVTOOL_SPDK_DIR={env_dir} has no build/bin/nvmf_tgt")
        return SpdkInstall(root)
    if not VENDOR.is_dir() or not BUILD_SCRIPT.is_file():
        raise SpdkNotFound(f"SPDK's sources are not at {VENDOR} (with {BUILD_SCRIPT}); "
                           "set KVTOOL_SPDK_DIR to a built SPDK tree")
    root = build_dir()
    if (root / ".kvtool-built").exists() and _usable(root):
        return SpdkInstall(root)
    if not build:
        raise SpdkNotFound(f"SPDK is not built yet: run `bash {BUILD_SCRIPT}` (about 5 minutes) "
                           "or set KVTOOL_SPDK_DIR")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ((root / ".kvtool-built").exists() and _usable(root)):
            if log:
                log(f"building SPDK from {VENDOR} into {root.parent} (minutes, once)")
            started = time.monotonic()
            out = subprocess.run(["bash", str(BUILD_SCRIPT), str(cache)], capture_output=True,
                                 text=True, env=dict(os.environ, PATH=SYSTEM_PATH),
                                 check=False)
            if out.returncode != 0:
                tail = " | ".join((out.stderr or out.stdout).strip().splitlines()[-5:])
                raise SpdkNotFound(f"{BUILD_SCRIPT} exited {out.returncode}: {tail}")
            if log:
                log(f"built SPDK in {time.monotonic() - started:.0f} s")
    if not _usable(root):
        raise SpdkNotFound(f"{BUILD_SCRIPT} finished but {root}/build/bin/nvmf_tgt is missing")
    return SpdkInstall(root)
