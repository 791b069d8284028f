"""The target runtimes: how the emulator backend (and SPDK started by kvtool) serves a
target. The one registry that ``kvtool target`` (``--runtime``, the config's ``runtime``,
:func:`kvtool.target.api.backend_for`, the sweep of dead background processes) and the
cluster layer (``kvtool cluster up --runtime``, a cluster target's check) read.

Cheap to import (no runtime module is imported until one is opened), so that argument
parsing can take its choices from here. Adding a runtime: docs/architecture.md, "Where to
add…".
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple


class Runtime(NamedTuple):
    """A registered runtime."""

    backend: str
    """``module:Class`` of the backend that serves it (``plan_up``/``plan_down``/``status``)."""
    opened_with: str = "record"
    """What the class is constructed from: ``record`` (the target's state record, or None)
    or ``configfs_root`` (the configfs directory option)."""
    background: bool = False
    """It runs as a background process recorded by pid (swept when that pid is gone)."""
    cluster: bool = False
    """It may serve a cluster's storage nodes (``kvtool cluster up --runtime``)."""
    choice: bool = True
    """A value of ``--runtime`` and of the config's ``runtime`` (``nvmf_tgt`` is not: it is
    ``[spdk] start = true``)."""


RUNTIMES: dict[str, Runtime] = {
    "kernel": Runtime("kvtool.target.emulator:KernelRuntime", opened_with="configfs_root"),
    "qemu": Runtime("kvtool.target.guest:QemuRuntime", background=True),
    "userspace": Runtime("kvtool.target.emulator:UserspaceRuntime", background=True,
                         cluster=True),
    "spdk": Runtime("kvtool.target.spdk.runtime:SpdkRuntime", background=True, cluster=True),
    "nvmf_tgt": Runtime("kvtool.target.spdk.runtime:ManagedSpdk", background=True,
                        choice=False),
}

AUTO = "auto"
"""The runtime chosen on the host: :func:`kvtool.target.emulator.resolve_runtime`."""

CHOICES: tuple[str, ...] = (AUTO, *(n for n, r in RUNTIMES.items() if r.choice))
"""``--runtime`` values and the config's ``runtime`` values."""

BACKGROUND: tuple[str, ...] = tuple(n for n, r in RUNTIMES.items() if r.background)
"""Runtimes that run as a recorded background process."""

CLUSTER: tuple[str, ...] = tuple(n for n, r in RUNTIMES.items() if r.cluster)
"""Runtimes that may serve a cluster's storage nodes; the first is the default."""


def open_runtime(name: str, *, record: Any = None, configfs_root: str | None = None) -> Any:
    """The backend of runtime ``name`` (one of :data:`RUNTIMES`)."""
    rt = RUNTIMES[name]
    module, _, cls = rt.backend.partition(":")
    backend = getattr(importlib.import_module(module), cls)
    return backend(configfs_root) if rt.opened_with == "configfs_root" else backend(record)
