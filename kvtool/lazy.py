"""Packages that export names without importing their modules until a name is used.

``import kvtool.trace.hashing`` runs ``kvtool/trace/__init__.py`` first; if that imported
every module of the package, each command would pay for modules it never uses (start-up:
bench/startup.py). A package lists its exports in ``__all__`` and which module holds each,
imports them under ``TYPE_CHECKING`` for type checkers, and installs :func:`exports`::

    __getattr__, __dir__ = exports(__name__, {"read_trace": "reader", ...})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any],
                                                            Callable[[], list[str]]]:
    """Module ``__getattr__``/``__dir__`` for ``package``: name → submodule holding it."""

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        globals_of(package)[name] = value  # next time, a plain attribute
        return value

    def dir_() -> list[str]:
        return sorted(set(globals_of(package)) | set(where))

    return getattr_, dir_


def globals_of(package: str) -> dict[str, Any]:
    return vars(importlib.import_module(package))
