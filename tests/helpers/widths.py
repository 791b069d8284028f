"""Render a command's human output at several terminal widths and check that it fits.

The rule (issue 22): at any width from 80 up, no cell of any command's human output is cut
or wraps mid-word. :func:`checking_widths` wraps ``emit`` in every command module, so each
human renderer a command reaches is also rendered at 80 and 120 columns (and at a width
where nothing needs to give) and checked by :func:`width_problems`.
"""

from __future__ import annotations

import importlib
import io
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvtool.cli import output
from kvtool.cli.main import COMMANDS

WIDTHS = (80, 120)
WIDE = 1000
_BOX = re.compile(r"[\u2500-\u257f]+")


def render(human: Callable[[Any], None], width: int) -> str:
    from rich.console import Console

    buf = io.StringIO()
    con = Console(file=buf, width=width, highlight=False, soft_wrap=False, color_system=None,
                  force_terminal=False)
    human(con)
    return buf.getvalue()


def _words(text: str) -> set[str]:
    return {w for line in text.splitlines() if not line.startswith(output.HIDDEN_NOTE)
            for w in _BOX.sub(" ", line).split()}


def _folded(fragment: str, wide: set[str], width: int) -> bool:
    """``fragment`` is a piece of a word too long to keep whole at ``width`` (a deep path:
    more than three quarters of the line, so it cannot sit beside a label), folded rather
    than cut; that is the only way to show all of it."""
    return any(len(w) > width * 3 // 4 and fragment in w for w in wide)


def width_problems(human: Callable[[Any], None]) -> list[str]:
    """What is wrong with ``human``'s output at 80 and 120 columns: a line longer than the
    width, an ellipsis (a cut cell), or a word that the unconstrained rendering does not
    have (a word cut or wrapped in the middle) unless the word is too long for any layout
    at that width (then folding it is right)."""
    wide = _words(render(human, WIDE))
    problems = []
    for width in WIDTHS:
        text = render(human, width)
        for line in text.splitlines():
            if len(line) > width:
                problems.append(f"{width} columns: line of {len(line)}: {line!r}")
            if "…" in line:
                problems.append(f"{width} columns: cut cell: {line!r}")
        broken = sorted(w for w in _words(text) - wide if not _folded(w, wide, width))
        if broken:
            problems.append(f"{width} columns: words broken: {broken[:8]}\n{text}")
    return problems


@contextmanager
def checking_widths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every ``emit`` of every command module also checks its human renderer's widths;
    yields the list of problems found (empty when all fit)."""
    problems: list[str] = []
    real = output.emit

    def emit(result: Any, human: Callable[[Any], None] | None = None) -> None:
        if human is not None:
            problems.extend(width_problems(human))
        real(result, human)

    for name in COMMANDS:
        module = importlib.import_module(f"kvtool.cli.{name}")
        if hasattr(module, "emit"):
            monkeypatch.setattr(module, "emit", emit)
    yield problems
