"""torch's companion packages that cannot load beside the torch an engine runs on.

``pip install '.[vllm]'`` installs vLLM's CPU build, which pins a CPU build of torch
(``torch==2.13.0+cpu``), and with it PyPI's torchvision, torchaudio and torchcodec, which
are built for PyPI's torch: beside the CPU torch they fail to import (``operator
torchvision::nms does not exist``; reference/real-engines.md). transformers imports them
when they are installed, so vLLM fails to start, although neither needs them for a text
model. :func:`hide_unloadable` (called by kvtool's engine processes before they import
vLLM or transformers) tries each and hides one that fails from this process only:
``sys.modules[name] = None``, so ``importlib.util.find_spec`` answers "not installed",
which transformers and vLLM handle. Nothing is uninstalled; a matching build imports and
stays usable.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

COMPANIONS: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")


def hide_unloadable(names: tuple[str, ...] = COMPANIONS) -> dict[str, str]:
    """Import each installed package of ``names``; hide those that fail to import (and
    whatever of them was half imported). Returns ``{name: why}`` of the hidden ones."""
    hidden: dict[str, str] = {}
    for name in names:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue  # imported (or hidden) already, or not installed
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure to load means "not usable here"
            for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[mod]
            sys.modules[name] = None  # type: ignore[assignment]  # find_spec -> None
            hidden[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return hidden
