"""``kvtool pool up / down / status``: a Mooncake Store pool on 127.0.0.1 for the emulator.

Two processes, both bound to 127.0.0.1:

* ``mooncake_master`` — object placement, leases, eviction; RPC on ``rpc_port`` and its
  Prometheus metrics / admin summary on ``metrics_port``;
* ``mooncake_http_metadata_server`` — the transfer engine's metadata (replaces etcd).
  Run on its own rather than the master's built-in one, which binds every interface.

Clients (the DRAM tier, :mod:`kvtool.mooncake.client`) contribute the memory and move the
bytes over Mooncake's TCP transport. The pool's record (pids, ports, URL, logs) is
``$STATE_DIR/pools/<name>.json``; ``up`` on a running pool does nothing, ``down`` stops
both processes (SIGTERM, then SIGKILL) and removes the record.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtool.errors import InputError, UsageError
from kvtool.mooncake.url import MooncakeUrl
from kvtool.target.state import state_dir

LOOPBACK = "127.0.0.1"
DEFAULT_RPC_PORT = 50051
DEFAULT_METADATA_PORT = 8080
DEFAULT_METRICS_PORT = 9003
START_TIMEOUT_S = 20.0


@dataclass
class PoolRecord:
    name: str
    rpc_port: int
    metadata_port: int
    metrics_port: int
    master_pid: int
    metadata_pid: int
    url: str
    logs: dict[str, str]
    started: float
    eviction_high_watermark: float
    eviction_ratio: float


def pools_dir() -> Path:
    return state_dir() / "pools"


def _record_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise UsageError(f"not a pool name: {name!r}", field="name")
    return pools_dir() / f"{name}.json"


def read_record(name: str) -> PoolRecord | None:
    path = _record_path(name)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"unreadable pool record: {exc}", file=path) from None
    return PoolRecord(**doc)


def _write_record(rec: PoolRecord) -> None:
    path = _record_path(rec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(rec), indent=2) + "\n")
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of this process still answers kill(0): reap it if it is ours.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((LOOPBACK, port)) == 0


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def mooncake_binary(name: str) -> str:
    """The mooncake executables: beside this Python (a virtualenv), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise UsageError(f"{name} not found: install the mooncake extra "
                         "(pip install 'kvtool[mooncake]'; Debian also needs libibverbs1)",
                         field="pool")
    return found


def _not_up(name: str) -> dict[str, Any]:
    """The document of a pool that is not up: the same keys as a running one's."""
    return {"schema": "kvtool.pool/1", "name": name, "running": False, "url": None,
            "master": None, "metadata": None, "metrics_url": None, "logs": None,
            "started": None, "eviction": None}


def status(name: str = "default") -> dict[str, Any]:
    """``{"name", "running", "url", "master", "metadata", "metrics_url", ...}``."""
    rec = read_record(name)
    if rec is None:
        return {**_not_up(name), "changed": None}
    procs = {"master": (rec.master_pid, rec.rpc_port), "metadata": (rec.metadata_pid,
                                                                    rec.metadata_port)}
    parts = {k: {"pid": pid, "port": port, "alive": _alive(pid), "listening": _listening(port)}
             for k, (pid, port) in procs.items()}
    running = all(p["alive"] and p["listening"] and _is_mooncake(p["pid"])
                  for p in parts.values())
    return {"schema": "kvtool.pool/1", "name": name, "running": running, "url": rec.url,
            "changed": None,
            **parts, "metrics_url": f"http://{LOOPBACK}:{rec.metrics_port}/metrics",
            "logs": rec.logs, "started": rec.started,
            "eviction": {"high_watermark": rec.eviction_high_watermark,
                         "ratio": rec.eviction_ratio}}


def up(name: str = "default", *, rpc_port: int = DEFAULT_RPC_PORT,
       metadata_port: int = DEFAULT_METADATA_PORT, metrics_port: int = DEFAULT_METRICS_PORT,
       eviction_high_watermark: float = 0.9, eviction_ratio: float = 0.05) -> dict[str, Any]:
    """Start the pool (idempotent); return :func:`status` plus ``changed``."""
    current = status(name)
    if current["running"]:
        return {**current, "changed": False}
    if current["url"] is not None:  # a stale record: clean up what is left of it
        down(name)
    for port, flag in ((rpc_port, "--rpc-port"), (metadata_port, "--metadata-port"),
                       (metrics_port, "--metrics-port")):
        if not _port_free(port):
            raise UsageError(f"127.0.0.1:{port} is in use", field=flag)
    if len({rpc_port, metadata_port, metrics_port}) != 3:
        raise UsageError("the three ports must differ", field="rpc_port")
    master, meta = (mooncake_binary("mooncake_master"),
                    mooncake_binary("mooncake_http_metadata_server"))
    logdir = state_dir() / "run"
    logdir.mkdir(parents=True, exist_ok=True)
    logs = {"master": str(logdir / f"pool-{name}-master.log"),
            "metadata": str(logdir / f"pool-{name}-metadata.log")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(logs["metadata"], "ab") as log:
            procs.append(subprocess.Popen(
                [meta, "--host", LOOPBACK, "--port", str(metadata_port), "--log-level", "WARNING"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True))
        with open(logs["master"], "ab") as log:
            procs.append(subprocess.Popen(
                [master, f"--rpc_address={LOOPBACK}", f"--rpc_port={rpc_port}",
                 f"--metrics_host={LOOPBACK}", f"--metrics_port={metrics_port}",
                 f"--eviction_high_watermark_ratio={eviction_high_watermark}",
                 f"--eviction_ratio={eviction_ratio}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc, port, what in ((procs[0], metadata_port, "metadata"),
                                 (procs[1], rpc_port, "master")):
            while not _listening(port):
                if proc.poll() is not None:
                    raise InputError(f"mooncake {what} exited with status {proc.returncode} "
                                     f"(log: {logs[what]})")
                if time.monotonic() > deadline:
                    raise InputError(f"mooncake {what} is not listening on 127.0.0.1:{port} "
                                     f"after {START_TIMEOUT_S:.0f} s (log: {logs[what]})")
                time.sleep(0.05)
    except BaseException:
        for proc in procs:
            _stop_pid(proc.pid)
        raise
    url = MooncakeUrl(LOOPBACK, rpc_port, LOOPBACK, metadata_port)
    _write_record(PoolRecord(name, rpc_port, metadata_port, metrics_port, procs[1].pid,
                             procs[0].pid, str(url), logs, time.time(),
                             eviction_high_watermark, eviction_ratio))
    return {**status(name), "changed": True}


def _is_mooncake(pid: int) -> bool:
    """Only a process that still runs a mooncake program is ours to stop (pids get reused)."""
    try:
        return b"mooncake" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _stop_pid(pid: int, timeout: float = 10.0) -> None:
    if not _is_mooncake(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def down(name: str = "default") -> dict[str, Any]:
    """Stop the pool's processes and forget it; ``changed`` is False when none was up."""
    rec = read_record(name)
    if rec is None:
        return {**_not_up(name), "changed": False}
    for pid in (rec.master_pid, rec.metadata_pid):
        _stop_pid(pid)
    _record_path(name).unlink(missing_ok=True)
    return {**_not_up(name), "changed": True}
