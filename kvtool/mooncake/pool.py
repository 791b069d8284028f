"""``kvtool pool up / down / status``: a Mooncake Store pool on 127.0.0.1 for the emulator.

Two processes, both bound to 127.0.0.1:

* ``mooncake_master`` — object placement, leases, eviction; RPC on ``rpc_port`` and its
  Prometheus metrics / admin summary on ``metrics_port``;
* ``mooncake_http_metadata_server`` — the transfer engine's metadata (replaces etcd).
  Run on its own rather than the master's built-in one, which binds every interface.

Clients (the DRAM tier, :mod:`kvtool.mooncake.client`) contribute the memory and move the
bytes over Mooncake's TCP transport. ``memory`` (``kvtool pool up --memory 1GiB``) adds a
third process, ``mooncake_client`` (Mooncake's standalone "real client"), that contributes
that much memory of its own: objects put there outlive the processes that put them (an
engine restarted finds the KV blocks it stored; the connector's DRAM tier on
``mooncake://`` contributes nothing and relies on it). The pool's record (pids, ports, URL, logs) is
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
from kvtool.target.state import pid_alive, state_dir

LOOPBACK = "127.0.0.1"
DEFAULT_RPC_PORT = 50051
DEFAULT_METADATA_PORT = 8080
DEFAULT_METRICS_PORT = 9003
DEFAULT_MEMORY_PORT = 50052
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
    memory_bytes: int = 0
    memory_pid: int = 0
    memory_port: int = 0


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
            "master": None, "metadata": None, "memory": None, "metrics_url": None, "logs": None,
            "started": None, "memory_bytes": None, "eviction": None}


def status(name: str = "default") -> dict[str, Any]:
    """``{"name", "running", "url", "master", "metadata", "metrics_url", ...}``."""
    rec = read_record(name)
    if rec is None:
        return {**_not_up(name), "changed": None}
    procs = {"master": (rec.master_pid, rec.rpc_port), "metadata": (rec.metadata_pid,
                                                                    rec.metadata_port)}
    if rec.memory_pid:
        procs["memory"] = (rec.memory_pid, rec.memory_port)
    parts = {k: {"pid": pid, "port": port, "alive": pid_alive(pid), "listening": _listening(port)}
             for k, (pid, port) in procs.items()}
    running = all(p["alive"] and p["listening"] and _is_mooncake(p["pid"])
                  for p in parts.values())
    return {"schema": "kvtool.pool/1", "name": name, "running": running, "url": rec.url,
            "changed": None, "memory": None,
            **parts, "metrics_url": f"http://{LOOPBACK}:{rec.metrics_port}/metrics",
            "logs": rec.logs, "started": rec.started,
            "memory_bytes": rec.memory_bytes,
            "eviction": {"high_watermark": rec.eviction_high_watermark,
                         "ratio": rec.eviction_ratio}}


def up(name: str = "default", *, rpc_port: int = DEFAULT_RPC_PORT,
       metadata_port: int = DEFAULT_METADATA_PORT, metrics_port: int = DEFAULT_METRICS_PORT,
       eviction_high_watermark: float = 0.9, eviction_ratio: float = 0.05,
       memory_bytes: int = 0, memory_port: int = DEFAULT_MEMORY_PORT) -> dict[str, Any]:
    """Start the pool (idempotent); return :func:`status` plus ``changed``.
    ``memory_bytes``: memory the pool holds itself (the ``mooncake_client`` process)."""
    current = status(name)
    if current["running"]:
        return {**current, "changed": False}
    if current["url"] is not None:  # a stale record: clean up what is left of it
        down(name)
    ports = [(rpc_port, "rpc_port"), (metadata_port, "metadata_port"),
             (metrics_port, "metrics_port")]
    if memory_bytes:
        ports.append((memory_port, "memory_port"))
    for port, key in ports:
        if not _port_free(port):
            raise UsageError(f"127.0.0.1:{port} is in use", field=key)
    if len({p for p, _k in ports}) != len(ports):
        raise UsageError("the ports must differ", field="rpc_port")
    if memory_bytes < 0:
        raise UsageError("must be a size ≥ 0", field="memory")
    master, meta = (mooncake_binary("mooncake_master"),
                    mooncake_binary("mooncake_http_metadata_server"))
    logdir = state_dir() / "run"
    logdir.mkdir(parents=True, exist_ok=True)
    logs = {"master": str(logdir / f"pool-{name}-master.log"),
            "metadata": str(logdir / f"pool-{name}-metadata.log")}
    if memory_bytes:
        logs["memory"] = str(logdir / f"pool-{name}-memory.log")
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
        waits = [(procs[0], metadata_port, "metadata"), (procs[1], rpc_port, "master")]
        if memory_bytes:
            _wait_listening(waits, logs)
            with open(logs["memory"], "ab") as log:
                procs.append(subprocess.Popen(
                    [mooncake_binary("mooncake_client"),
                     f"-global_segment_size={memory_bytes}", f"-host={LOOPBACK}",
                     f"-port={memory_port}", f"-master_server_address={LOOPBACK}:{rpc_port}",
                     f"-metadata_server=http://{LOOPBACK}:{metadata_port}/metadata",
                     "-protocol=tcp"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True))
            waits = [(procs[2], memory_port, "memory")]
        _wait_listening(waits, logs)
    except BaseException:
        for proc in procs:
            _stop_pid(proc.pid)
        raise
    url = MooncakeUrl(LOOPBACK, rpc_port, LOOPBACK, metadata_port)
    _write_record(PoolRecord(name, rpc_port, metadata_port, metrics_port, procs[1].pid,
                             procs[0].pid, str(url), logs, time.time(),
                             eviction_high_watermark, eviction_ratio, memory_bytes,
                             procs[2].pid if memory_bytes else 0,
                             memory_port if memory_bytes else 0))
    return {**status(name), "changed": True}


def _wait_listening(waits: list[tuple[subprocess.Popen[bytes], int, str]],
                    logs: dict[str, str]) -> None:
    """Each process listens on its port, or InputError naming its log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for proc, port, what in waits:
        while not _listening(port):
            if proc.poll() is not None:
                raise InputError(f"mooncake {what} exited with status {proc.returncode} "
                                 f"(log: {logs[what]})")
            if time.monotonic() > deadline:
                raise InputError(f"mooncake {what} is not listening on 127.0.0.1:{port} "
                                 f"after {START_TIMEOUT_S:.0f} s (log: {logs[what]})")
            time.sleep(0.05)


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
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def down(name: str = "default") -> dict[str, Any]:
    """Stop the pool's processes and forget it; ``changed`` is False when none was up."""
    rec = read_record(name)
    if rec is None:
        return {**_not_up(name), "changed": False}
    for pid in (rec.memory_pid, rec.master_pid, rec.metadata_pid):
        if pid:
            _stop_pid(pid)
    _record_path(name).unlink(missing_ok=True)
    return {**_not_up(name), "changed": True}
