"""Load vLLM's CPU offloading manager and cache policies from an installed vLLM, without
torch, a GPU or vLLM's package ``__init__`` (docs: ../shared/reference/serving-model.md §5).

``pip install --no-deps vllm==0.33.0`` (plus msgspec, numpy, typing_extensions) is enough:
the modules that hold the cache logic (``vllm/v1/kv_offload/base.py``, ``cpu/manager.py``,
``cpu/policies/{base,lru,arc,factory}.py``) run unmodified. Stand-ins are given only for
what they import for type hints or for features the replay does not call: ``torch`` (one
type name), ``vllm.logger`` (logging), and the connector's metrics module (``get_stats``).

:func:`load` returns ``None`` when vLLM is not installed, so tests skip with a reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
"""The vLLM release whose offloading code the ``vllm-*`` policies reproduce."""

_PACKAGES = ("", "distributed", "distributed.kv_transfer", "distributed.kv_transfer.kv_connector",
             "distributed.kv_transfer.kv_connector.v1",
             "distributed.kv_transfer.kv_connector.v1.offloading", "utils")
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"


def vllm_root() -> Path | None:
    """The directory of the installed ``vllm`` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm") if "vllm" not in sys.modules else None
    if spec is None:
        mod = sys.modules.get("vllm")
        paths = list(getattr(mod, "__path__", [])) if mod is not None else []
        return Path(paths[0]) if paths else None
    if not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _version(root: Path) -> str | None:
    for info in root.parent.glob("vllm-*.dist-info"):
        return info.name[len("vllm-"):-len(".dist-info")]
    return None


def _package(name: str, path: Path) -> None:
    """Register ``name`` as a package at ``path`` without running its ``__init__``."""
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    sys.modules[name] = mod


class _LoggerModule(types.ModuleType):
    """``vllm.logger`` stand-in: ``init_logger`` gives a standard logger; any other name
    (``set_vllm_process_name``, … that other vLLM modules import) is a no-op function."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def _stubs() -> None:
    if "torch" not in sys.modules:
        # the oracle's permissive stand-in (any attribute a class, a package), so that
        # vLLM's other modules loaded in the same process (tests/helpers/vllm_oracle.py)
        # find what they use of torch too
        from tests.helpers.vllm_oracle import StubModule

        torch = StubModule("torch")
        sys.modules["torch"] = torch
    if "vllm.logger" not in sys.modules:
        logger_mod = _LoggerModule("vllm.logger")

        def init_logger(name: str) -> Any:
            log = logging.getLogger(name)
            log.warning_once = log.warning  # type: ignore[attr-defined]
            log.info_once = log.info  # type: ignore[attr-defined]
            return log

        logger_mod.init_logger = init_logger  # type: ignore[attr-defined]
        sys.modules["vllm.logger"] = logger_mod
    if _METRICS not in sys.modules:
        metrics = types.ModuleType(_METRICS)
        metrics.OffloadingConnectorStats = type(  # type: ignore[attr-defined]
            "OffloadingConnectorStats", (), {})
        sys.modules[_METRICS] = metrics


def load() -> types.SimpleNamespace | None:
    """vLLM's offloading classes, or None when vLLM (of the expected version) is missing.

    Attributes: ``CPUOffloadingManager``, ``ReqContext``, ``LookupResult``,
    ``make_offload_key``, ``version``.
    """
    root = vllm_root()
    if root is None or not (root / "v1" / "kv_offload" / "cpu" / "manager.py").exists():
        return None
    # vLLM's core first, the way tests/helpers/vllm_oracle.py loads it (hollow packages,
    # stand-ins), so that both helpers share one set of vLLM modules in a process
    from tests.helpers.vllm_oracle import load_vllm_core

    try:
        load_vllm_core()
    except ImportError:
        return None
    version = _version(root)
    for sub in _PACKAGES:
        name = "vllm" + ("." + sub if sub else "")
        _package(name, root.joinpath(*sub.split(".")) if sub else root)
    _stubs()
    base = importlib.import_module("vllm.v1.kv_offload.base")
    manager = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
    return types.SimpleNamespace(
        CPUOffloadingManager=manager.CPUOffloadingManager, ReqContext=base.ReqContext,
        LookupResult=base.LookupResult, make_offload_key=base.make_offload_key,
        version=version)
