"""Where ``kvtool target up`` records what it brought up, so later commands find it.

One JSON file per target name under the state directory:
``$KVTOOL_STATE_DIR``, else ``/var/lib/kvtool`` when running as root, else
``$XDG_STATE_HOME/kvtool`` (``~/.local/state/kvtool``); files live in ``targets/``.

A record holds the backend and runtime, the config's path, text and digest (the digest of
the desired state: equal digests mean ``up`` has nothing to do), the background process
(pid) when there is one, and the addresses hosts use (``nvme+tcp://`` URLs). Writes are
atomic (temp file, fsync, rename), so a crash never leaves half a record.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtool.errors import InputError
from kvtool.jsondoc import save_record


def state_dir() -> Path:
    env = os.environ.get("KVTOOL_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/kvtool")
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "kvtool"


def targets_dir() -> Path:
    """One ``<name>.json`` record per target."""
    return state_dir() / "targets"


def run_dir() -> Path:
    """Files of running targets: generated configs, ready files, logs of background processes."""
    return state_dir() / "run"


@dataclass
class TargetState:
    name: str
    backend: str
    runtime: str | None
    config_path: str | None
    config_text: str  # the config as applied (re-parsed to find what the target owns)
    config_format: str  # "toml" | "json"
    digest: str
    created: float = field(default_factory=time.time)
    pid: int | None = None  # background process (userspace target, QEMU supervisor)
    pid_start: int | None = None  # its start time (kvtool.target.procs.start_time): reuse check
    endpoints: list[dict[str, Any]] = field(default_factory=list)  # per subsystem/namespace
    extra: dict[str, Any] = field(default_factory=dict)  # runtime details (control port, logs)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def path(self) -> Path:
        return targets_dir() / f"{self.name}.json"


def save(state: TargetState) -> Path:
    return save_record(state.path, state.to_json())


def load(name: str) -> TargetState | None:
    path = targets_dir() / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"unreadable target state: {exc}", file=str(path)) from None
    try:
        return TargetState(**renamed_keys(data))
    except TypeError as exc:
        raise InputError(f"target state has an unexpected shape: {exc}", file=str(path)) from None


def renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A target or process record as written before ``engine`` was renamed ``runtime``
    (and ``extra.engine_config`` ``extra.runtime_config``), in today's keys: records of
    targets started by an older kvtool stay readable, so ``down`` still finds them."""
    if "engine" in data and "runtime" not in data:
        data = {("runtime" if k == "engine" else k): v for k, v in data.items()}
    extra = data.get("extra")
    if isinstance(extra, dict) and "engine_config" in extra and "runtime_config" not in extra:
        data = {**data, "extra": {("runtime_config" if k == "engine_config" else k): v
                                  for k, v in extra.items()}}
    return data


def remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (targets_dir() / f"{name}.json").unlink()


def names() -> list[str]:
    d = targets_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.json"))


def pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs. A zombie (exited, not yet reaped by its parent) counts
    as gone; when it is this process's child it is reaped here, so it does not linger."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True
    if zombie:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return not zombie
