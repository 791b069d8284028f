"""Where data mode puts its NVMe tier by default: the running built-in target (found
from its record), else a store file in kvtool's cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from kvtool.replay.settings import DEFAULT_NVME_FILE_BYTES


def cache_dir() -> Path:
    env = os.environ.get("KVTOOL_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtool"


def default_nvme_place() -> tuple[str, str, int | None]:
    """(place, why, bytes to create) for the default NVMe tier."""
    from kvtool.target import default
    from kvtool.target import state as st

    record = st.load(default.NAME)
    if record is not None and st.pid_alive(record.pid):
        for ep in record.endpoints:
            for lst in ep.get("listeners", []):
                if lst.get("transport") == "tcp":
                    url = f"nvme+tcp://{lst['address']}:{lst['port']}/{ep['nqn']}/1"
                    return url, "the running kvtool target (kvtool target up)", None
    path = cache_dir() / "replay-nvme.img"
    why = f"no kvtool target is up: a store file kvtool keeps; rm {path} removes it"
    if path.exists():
        return str(path), why, None
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path), why, DEFAULT_NVME_FILE_BYTES
