"""kvtool.integrations.torchextras: a companion package that fails to import is hidden
from the process (as PyPI's torchvision is beside vLLM's CPU torch), one that imports is
left alone."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtool.integrations.torchextras import hide_unloadable


@pytest.fixture
def packages(tmp_path: Path) -> Iterator[Path]:
    """A directory on sys.path; the test's modules are forgotten afterwards."""
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("kvt_extra_")]:
            del sys.modules[name]
        importlib.invalidate_caches()


def test_a_package_that_fails_to_import_is_hidden(packages: Path) -> None:
    broken = packages / "kvt_extra_broken"
    broken.mkdir()
    (broken / "ops.py").write_text("LOADED = True\n")
    (broken / "__init__.py").write_text(
        "from . import ops\nraise RuntimeError('operator kvt_extra_broken::nms does not exist')\n")
    good = packages / "kvt_extra_good"
    good.mkdir()
    (good / "__init__.py").write_text("VALUE = 7\n")
    importlib.invalidate_caches()
    hidden = hide_unloadable(("kvt_extra_broken", "kvt_extra_good", "kvt_extra_absent"))
    assert hidden == {"kvt_extra_broken":
                      "RuntimeError: operator kvt_extra_broken::nms does not exist"}
    # what transformers asks: "not installed"; an import fails cleanly
    assert importlib.util.find_spec("kvt_extra_broken") is None
    assert "kvt_extra_broken.ops" not in sys.modules  # nothing half-imported is left
    with pytest.raises(ImportError):
        importlib.import_module("kvt_extra_broken")
    assert importlib.import_module("kvt_extra_good").VALUE == 7  # left alone
    assert hide_unloadable(("kvt_extra_broken",)) == {}  # once is enough
