"""Output conventions shared by every command.

* ``--json`` (global, or on any command): one JSON document on stdout, nothing else
  there; diagnostics and progress go to stderr.
* Otherwise human output via rich on stdout, progress bars on stderr.

Commands build a plain ``dict``/``list`` result first and then either dump it
(``--json``) or render it for people, so the two views can never disagree.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import click

from kvtool.jsondoc import dump_json

if TYPE_CHECKING:  # rich costs ~35 ms to import: only human output pays for it
    from rich.console import Console
    from rich.progress import Progress, TaskID

F = TypeVar("F", bound=Callable[..., Any])


class Settings:
    """Global CLI settings, stored as ``ctx.obj``."""

    __slots__ = ("debug", "json", "quiet")

    def __init__(self, json: bool = False, debug: bool = False, quiet: bool = False) -> None:
        self.json, self.debug, self.quiet = json, debug, quiet


def settings() -> Settings:
    ctx = click.get_current_context()
    obj = ctx.find_object(Settings)
    if obj is None:
        obj = ctx.ensure_object(Settings)
    return obj


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.ensure_object(Settings).json = True
    return value


def _set_quiet(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.ensure_object(Settings).quiet = True
    return value


def json_option(f: F) -> F:
    """Add ``--json`` and ``-q/--quiet`` to a command (the group has them too; either place
    works)."""
    f = click.option(
        "-q", "--quiet",
        "quiet_flag",
        is_flag=True,
        expose_value=False,
        callback=_set_quiet,
        is_eager=True,
        help="No progress bars or notes on stderr.",
    )(f)
    return click.option(
        "--json",
        "json_flag",
        is_flag=True,
        expose_value=False,
        callback=_set_json,
        is_eager=True,
        help="Machine output: one JSON document on stdout (schema in docs/json.md).",
    )(f)


def want_json() -> bool:
    return settings().json


_stdout: Console | None = None
_stderr: Console | None = None


def _width(stream: Any) -> int | None:
    """Terminal width on a tty; otherwise $COLUMNS or 80 (a pipe into ``less`` in an
    80-column terminal must not wrap; ``COLUMNS=200 kvtool … | tee log`` widens a log)."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return None
    return int(os.environ.get("COLUMNS") or 0) or 80


def _same(current: Any, stream: Any) -> bool:
    """Whether ``current`` writes to ``stream``, or to what a rich live display (a progress
    bar) redirected ``stream`` from: a second console on its proxy would print the bar
    twice."""
    return current is stream or getattr(stream, "rich_proxied_file", None) is current


def console() -> Console:
    """Human output (stdout). Re-created per stream so CliRunner captures it."""
    from rich.console import Console

    global _stdout
    if _stdout is None or not _same(_stdout.file, sys.stdout):
        # emoji=False: kvtool prints no :emoji: codes (a "name:id:" in a path or NQN must
        # stay as written), and rich then skips importing its emoji table
        _stdout = Console(file=sys.stdout, highlight=False, soft_wrap=False, emoji=False,
                          width=_width(sys.stdout))
    return _stdout


def err_console() -> Console:
    from rich.console import Console

    global _stderr
    if _stderr is None or not _same(_stderr.file, sys.stderr):
        _stderr = Console(file=sys.stderr, highlight=False, stderr=True, emoji=False,
                          width=_width(sys.stderr))
    return _stderr


class Column(NamedTuple):
    """One column of a :func:`print_table`: its header (``\\n`` splits it over lines), how its
    cells are justified, and its ``rank``: 0 is always shown; when the table is wider than the
    console, the column with the highest rank goes first (ties: the rightmost). ``wrap``:
    prose, which may wrap between words (never inside one)."""

    header: str
    justify: str = "right"
    rank: int = 0
    wrap: bool = False


HIDDEN_NOTE = "not shown at this width:"


def print_table(con: Console, columns: list[Column], rows: list[list[str] | None], *,
                title: str | None = None, box: Any = None, more: str = "",
                show_header: bool = True, styles: dict[int, str] | None = None) -> list[str]:
    """Print ``rows`` (``None``: a section line) as a table that fits ``con.width``.

    Invariant: no cell is cut, and only ``wrap`` columns wrap (between words). Columns
    are dropped, highest ``rank`` first, until the table fits (``wrap`` columns counted
    at their longest word), and one line names the columns left out and ``more``: where
    to see them, e.g. ``--csv FILE``. Columns of rank 0 always stay. Returns the headers
    left out.
    """
    from rich import box as boxes
    from rich.table import Table

    shown = list(range(len(columns)))

    def longest_word(text: str) -> str:
        return max(text.split(), key=len, default="")

    def build(measuring: bool = False) -> Table:
        t = Table(title=None if measuring else title, title_justify="left",
                  box=box if box is not None else boxes.HEAVY_HEAD, show_header=show_header)
        for i in shown:
            c = columns[i]
            t.add_column(c.header, justify=c.justify,  # type: ignore[arg-type]
                         no_wrap=not c.wrap, overflow="fold" if c.wrap else "ellipsis",
                         style=(styles or {}).get(i))
        for row in rows:
            if row is None:
                t.add_section()
            else:
                t.add_row(*(longest_word(row[i]) if measuring and columns[i].wrap else row[i]
                            for i in shown))
        return t

    def natural_width() -> int:  # unclamped: console.measure caps it at the width
        return build(True).__rich_measure__(con, con.options.update_width(1 << 20)).maximum

    while natural_width() > con.width:
        droppable = [i for i in shown if columns[i].rank > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (columns[i].rank, i)))
    con.print(build())
    hidden = [columns[i].header.replace("\n", " ") for i in range(len(columns)) if i not in shown]
    if hidden:
        line = f"{HIDDEN_NOTE} {', '.join(hidden)}" + (f" ({more})" if more else "")
        for shorter in (f"{HIDDEN_NOTE} {len(hidden)} columns" + (f" ({more})" if more else ""),
                        f"{HIDDEN_NOTE} {len(hidden)} columns"):
            if len(line) > con.width:
                line = shorter
        con.print(f"[dim]{line}[/]", soft_wrap=True)
    return hidden


def shown_path(path: str) -> str:
    """``path`` as a person reads it: relative to the working directory when it lies under
    it (a deep absolute path would not fit an 80-column cell), otherwise as given. Only
    human output uses this; ``--json`` keeps the absolute path."""
    if not os.path.isabs(path):
        return path
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def emit(result: Any, human: Callable[[Console], None] | None = None) -> None:
    """Print ``result`` as JSON (``--json``) or call ``human`` to render it with rich."""
    if want_json() or human is None:
        click.echo(dump_json(result))
    else:
        human(console())


def note(message: str, *, whole: bool = False) -> None:
    """A human note on stderr (never pollutes ``--json`` stdout). ``whole``: one line as
    it is, never broken by the console (a ``FILE:LINE: message`` a reader copies; the
    terminal may still fold it)."""
    if not settings().quiet:
        err_console().print(message, soft_wrap=whole)


class Bar:
    """One task of a rich progress bar: ``bar(n)`` / ``bar.advance(n)`` and ``bar.set_total(n)``
    (for libraries that learn the total only once they have opened the target). Without a
    ``Progress`` (``--json``, ``-q``) both do nothing."""

    def __init__(self, progress: Progress | None = None, task: TaskID | None = None) -> None:
        self._progress = progress
        self._task = task

    def advance(self, n: float = 1) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)

    __call__ = advance

    def set_total(self, total: float) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, total=total)


@contextmanager
def progress(description: str, total: float | None = None, *, unit: str = "") -> Iterator[Bar]:
    """A rich progress bar on stderr; yields a :class:`Bar`.

    Hidden when stderr is not a terminal, with ``-q`` and with ``--json``, so CI logs and
    machine output stay clean.
    """
    if want_json() or settings().quiet or not sys.stderr.isatty():
        yield Bar()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err_console(), transient=False) as bar:
        yield Bar(bar, bar.add_task(description + (f" ({unit})" if unit else ""), total=total))
