"""One record per process that ``kvtool target up`` starts, so that no later command loses it.

A background target (the userspace target, SPDK's ``nvmf_tgt``, the QEMU guest's
supervisor) outlives the ``kvtool`` that started it. Its record lives in
``<state dir>/processes/<token>.json`` (:func:`kvtool.target.state.state_dir`) and holds
what finds and identifies it again: the pid and the process's start time (so a reused pid is
never mistaken for it), the target, backend and runtime it serves, the TCP ports it listens
on, its Unix sockets, work directory and log.

Invariants:

* The record is written **before** the process is started (with ``pid`` None), and again
  as soon as it has a pid: a ``kvtool`` killed at any point of ``up`` leaves a record.
  Every process started under a record carries ``KVTOOL_PROCESS_TOKEN=<token>`` in its
  environment, and so do its children (QEMU under the supervisor); :func:`members` finds
  them by it even when the pid was never written.
* A record is removed only once no process carrying its token is left
  (:func:`stop`), or when its process is found gone (:func:`sweep`, which says so).
* A process is "the recorded one" only when its pid is alive, not a zombie, and its start
  time equals the recorded one (or it carries the token).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtool.errors import InputError
from kvtool.target import state as st
from kvtool.target.plan import TargetError

TOKEN_ENV = "KVTOOL_PROCESS_TOKEN"
STOP_TIMEOUT = 15.0
KILL_TIMEOUT = 5.0


_children: dict[int, subprocess.Popen[bytes]] = {}  # started by this process: reaped on stop


def adopt(proc: subprocess.Popen[bytes]) -> None:
    """Remember a child this process started, so that stopping it also reaps it."""
    _children[proc.pid] = proc


def reap(pid: int | None) -> bool:
    """Collect ``pid``'s exit status when this process started it; True once it exited."""
    proc = _children.get(pid or -1)
    if proc is None:
        return False
    if proc.poll() is not None:
        _children.pop(proc.pid, None)
        return True
    return False


def processes_dir() -> Path:
    return st.state_dir() / "processes"


@dataclass
class ProcessRecord:
    """One started process. ``phase``: "starting" until ``up`` saw it ready, then "up"."""

    target: str
    backend: str
    runtime: str | None
    role: str  # what it is, for people: "userspace target", "nvmf_tgt", "QEMU supervisor"
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    pid: int | None = None
    start_time: int | None = None  # /proc/<pid>/stat field 22: clock ticks after boot
    argv: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)  # TCP ports it listens on
    sockets: list[str] = field(default_factory=list)  # Unix sockets (SPDK RPC)
    workdir: str | None = None  # removed with the process
    # files the process removes itself when it exits cleanly but leaves when killed (SPDK's
    # trace buffer in /dev/shm): removed with the record once the process is gone
    leftovers: list[str] = field(default_factory=list)
    log: str | None = None
    phase: str = "starting"
    config_text: str | None = None  # the target's config (kvtool JSON), for a later down
    created: float = field(default_factory=time.time)

    @property
    def path(self) -> Path:
        return processes_dir() / f"{self.token}.json"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this environment) with this record's token."""
        env = dict(os.environ if base is None else base)
        env[TOKEN_ENV] = self.token
        return env

    def describe(self) -> str:
        what = self.backend + (f" {self.runtime} runtime" if self.runtime else "")
        pid = f"pid {self.pid}" if self.pid else "pid not yet recorded"
        return f"{self.role} {pid} of target {self.target!r} ({what})"

    def save(self) -> Path:
        _write_atomic(self.path, json.dumps(asdict(self), indent=2, sort_keys=True).encode())
        return self.path

    def started(self, pid: int, leftovers: list[str] | None = None) -> None:
        """Record the pid (and its start time) of the process just started, and the files
        it may leave behind (they often name the pid)."""
        self.pid = pid
        self.start_time = start_time(pid)
        if leftovers is not None:
            self.leftovers = leftovers
        self.save()

    def ready(self) -> None:
        self.phase = "up"
        self.save()

    def forget(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def records(target: str | None = None) -> list[ProcessRecord]:
    """Every process record (of ``target``), oldest first."""
    d = processes_dir()
    if not d.is_dir():
        return []
    out = []
    for path in d.glob("*.json"):
        try:
            data = json.loads(path.read_text())
            rec = ProcessRecord(**st.renamed_keys(data))
        except FileNotFoundError:
            continue
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise InputError(f"unreadable process record: {exc}", file=str(path)) from None
        if target is None or rec.target == target:
            out.append(rec)
    return sorted(out, key=lambda r: r.created)


def by_pid(pid: int | None) -> ProcessRecord | None:
    if not pid:
        return None
    return next((r for r in records() if r.pid == pid), None)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _has_token(pid: int, token: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{TOKEN_ENV}={token}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def is_recorded_process(rec: ProcessRecord) -> bool:
    """The recorded pid is alive and is the recorded process (not a reused pid)."""
    if not rec.pid or not st.pid_alive(rec.pid):
        return False
    if rec.start_time is not None:
        return start_time(rec.pid) == rec.start_time
    return _has_token(rec.pid, rec.token)


def members(rec: ProcessRecord) -> list[int]:
    """Live pids of this record: the recorded process and every process with its token."""
    pids = {rec.pid} if rec.pid and is_recorded_process(rec) else set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid() and \
                _has_token(int(entry.name), rec.token) and st.pid_alive(int(entry.name)):
            pids.add(int(entry.name))
    return sorted(p for p in pids if p)


def alive(rec: ProcessRecord) -> bool:
    return bool(members(rec))


def stop(rec: ProcessRecord, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM the recorded process (its process group), wait ``timeout``, then SIGKILL
    everything carrying the token; remove the record and its work directory.

    Raises :class:`TargetError` (the record kept) when a process cannot be signalled or is
    still there after SIGKILL.
    """
    pids = members(rec)
    main = rec.pid if rec.pid in pids else (pids[0] if pids else None)
    if main is not None:
        _signal(rec, main, signal.SIGTERM, group=True)
        deadline = time.monotonic() + timeout
        while st.pid_alive(main) and time.monotonic() < deadline:
            if reap(main):
                break
            time.sleep(0.05)
    left = members(rec)
    for pid in left:
        _signal(rec, pid, signal.SIGKILL, group=False)
    deadline = time.monotonic() + KILL_TIMEOUT
    while left and time.monotonic() < deadline:
        for pid in left:
            reap(pid)
        time.sleep(0.05)
        left = members(rec)
    if left:
        raise TargetError(f"cannot stop {rec.describe()}: pid(s) {', '.join(map(str, left))} "
                          f"still running after SIGKILL; its record is kept ({rec.path})")
    _remove_files(rec)
    rec.forget()


def _remove_files(rec: ProcessRecord) -> None:
    """What a stopped or vanished process leaves: its work directory and leftovers."""
    if rec.workdir:
        import shutil
        shutil.rmtree(rec.workdir, ignore_errors=True)
    for path in rec.leftovers:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _signal(rec: ProcessRecord, pid: int, sig: signal.Signals, *, group: bool) -> None:
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return
    except PermissionError:
        raise TargetError(f"cannot stop {rec.describe()}: not permitted to signal pid {pid} "
                          f"(run as the user who started it); its record is kept "
                          f"({rec.path})") from None


def sweep(target: str | None = None) -> list[str]:
    """Remove the records whose processes are gone; one note per record removed."""
    notes = []
    for rec in records(target):
        if rec.pid is None and time.time() - rec.created < 5.0:
            continue  # an `up` is between writing the record and starting the process
        if alive(rec):
            continue
        reused = rec.pid is not None and st.pid_alive(rec.pid)
        why = "its pid now belongs to another process" if reused else "it is no longer running"
        notes.append(f"{rec.describe()}: {why}; its record was removed")
        _remove_files(rec)
        rec.forget()
    return notes


def port_holder(port: int, *, except_target: str | None = None) -> ProcessRecord | None:
    """The live recorded process (of another target than ``except_target``) listening on
    ``port``."""
    for rec in records():
        if rec.target != except_target and port in rec.ports and alive(rec):
            return rec
    return None


def summary(rec: ProcessRecord) -> dict[str, Any]:
    """The record as ``status`` reports it."""
    return {"pid": rec.pid, "start_time": rec.start_time, "role": rec.role,
            "backend": rec.backend, "runtime": rec.runtime, "phase": rec.phase,
            "ports": list(rec.ports), "sockets": list(rec.sockets), "log": rec.log,
            "record": str(rec.path), "running": alive(rec)}
