"""Output conventions: tables that fit the width, one stderr console under a live bar."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable

import pytest
from rich.console import Console
from rich.live import Live

from kvtool.cli import output
from kvtool.cli.output import HIDDEN_NOTE, Column, print_table
from tests.helpers.widths import width_problems


def _table(con: Console) -> list[str]:
    cols = [Column("name", justify="left"), Column("important"), Column("detail", rank=2),
            Column("extra", rank=1), Column("prose", justify="left", wrap=True, rank=3)]
    rows: list[list[str] | None] = [
        ["alpha", "1,234,567", "a-long-unbreakable-detail", "x" * 12,
         "words that may wrap between them but never inside"],
        None,
        ["total", "9,999,999", "-", "-", "-"]]
    return print_table(con, cols, rows, title="a title", more="--json has them")


@pytest.mark.parametrize("width", [30, 50, 80, 200])
def test_print_table_drops_columns_by_rank_and_says_which(width: int) -> None:
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None)
    hidden = _table(con)
    text = buf.getvalue()
    assert "…" not in text
    kept = {"name", "important", "detail", "extra", "prose"} - set(hidden)
    assert {"name", "important"} <= kept
    assert set(hidden) == set(["prose", "detail", "extra"][:len(hidden)])  # highest rank first
    assert (HIDDEN_NOTE in text) == bool(hidden)
    if width >= 50:
        assert all(len(line) <= width for line in text.splitlines())


def test_width_problems_finds_cut_and_broken_cells() -> None:
    from rich.table import Table

    def squeezed(con: Console) -> None:
        t = Table()
        t.add_column("footprint", no_wrap=True)
        for i in range(3):  # words of 35 fit a line, but not three side by side
            t.add_column(str(i), overflow="fold")
        t.add_row("149.97 GB", "x" * 35, "y" * 35, "z" * 35)
        con.print(t)

    def fitted(con: Console) -> None:
        _table(con)

    assert width_problems(squeezed)
    assert not width_problems(fitted)


def test_a_path_too_long_for_the_line_may_be_folded_but_not_cut() -> None:
    from rich.table import Table

    deep = "/" + "/".join(["deep-directory"] * 7) + "/ns.img"  # 111 characters

    def table(overflow: str) -> Callable[[Console], None]:
        def human(con: Console) -> None:
            t = Table(show_header=False)
            t.add_column()
            t.add_column(overflow=overflow)  # type: ignore[arg-type]
            t.add_row("target", f"{deep} (file)")
            t.add_row("short", "word " * 30)
            con.print(t)
        return human

    assert not width_problems(table("fold"))
    assert any("cut cell" in p for p in width_problems(table("ellipsis")))


def test_one_stderr_console_under_a_live_display(monkeypatch: pytest.MonkeyPatch) -> None:
    """A note printed while a progress bar is live goes through the bar's console (a second
    console on rich's stderr proxy printed the bar twice)."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal, so that Live redirects stderr
    con = output.err_console()
    assert con.file is sys.stderr and con.is_terminal
    with Live("bar", console=con, redirect_stderr=True):
        assert sys.stderr is not con.file  # rich redirected it
        assert output.err_console() is con
    assert output.err_console() is con


def test_piped_output_follows_columns_or_80() -> None:
    from click.testing import CliRunner

    from kvtool.cli.main import cli
    from tests.conftest import FIXTURES

    args = ["replay", "--simulate", str(FIXTURES / "traces" / "multiturn-8x12.jsonl"),
            "--gpu", "20blk", "--dram", "300blk", "--nvme", "inf"]
    narrow = CliRunner(env={"COLUMNS": ""}).invoke(cli, args)
    assert narrow.exit_code == 0
    assert max(map(len, narrow.stdout.splitlines())) <= 80 and HIDDEN_NOTE in narrow.stdout
    wide = CliRunner(env={"COLUMNS": "250"}).invoke(cli, args)
    assert max(map(len, wide.stdout.splitlines())) > 120 and HIDDEN_NOTE not in wide.stdout
