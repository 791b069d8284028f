"""``--help`` that fits the terminal: the verbatim blocks (click's ``\\b``) rewrapped.

click rewraps ordinary paragraphs to the terminal but prints a ``\\b`` block (examples,
aligned tables) as written, so a terminal narrower than the text breaks its lines
mid-word. :func:`fit_help` makes a command print such blocks at the formatter's width:

* an example (a line starting ``kvtool``, or a continuation after a trailing ``\\``)
  breaks between shell words (quoted words stay whole) with `` \\`` continuations
  indented four more spaces; a trailing ``# comment`` goes on its own line above;
* any other line wraps between words, continuation lines aligned with its second
  column (the text after the first run of two spaces) or its own indentation.

Lines that fit are left alone, so at 100 columns the help reads as written.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import click

_WORD = r"""(?:'[^']*'|"[^"]*"|\S)+"""  # compiled on first use (help only)


def _units(body: str) -> list[str]:
    """Shell words, an option kept with its value (``--dram 429.5GB`` breaks as one)."""
    words = re.findall(_WORD, body)
    units: list[str] = []
    for w in words:
        if units and units[-1].startswith("-") and " " not in units[-1] and not w.startswith("-"):
            units[-1] += " " + w
        else:
            units.append(w)
    return units


def _wrap_command(line: str, width: int, continued: bool) -> list[str]:
    lead = line[:len(line) - len(line.lstrip())]
    body = line.strip()
    out: list[str] = []
    code, hash_, comment = body.partition("  #")
    if hash_:
        out.append(f"{lead}#{comment.rstrip()}")
        body = code.rstrip()
    cont = body.endswith("\\")
    more = lead if continued else lead + "    "
    cur = lead
    for w in _units(body.rstrip("\\").strip()):
        if cur.strip() and len(cur) + 1 + len(w) + 2 > width:
            out.append(cur + " \\")
            cur = more + w
        else:
            cur += (" " if cur.strip() else "") + w
    out.append(cur + (" \\" if cont else ""))
    return out


def _is_table(line: str) -> bool:
    return re.search(r"\S {2,}\S", line.strip()) is not None


def _wrap_table(line: str, width: int) -> list[str]:
    lead = len(line) - len(line.lstrip())
    gap = re.search(r"\S( {2,})\S", line[lead:])
    hang = lead + gap.end(1) if gap and lead + gap.end(1) < width // 2 else lead
    head = line[:hang]
    import textwrap  # only --help wraps (start-up time)

    rest = textwrap.wrap(line[hang:], width - hang, break_long_words=False,
                         break_on_hyphens=False)
    return [head + rest[0]] + [" " * hang + r for r in rest[1:]]


def _wrap_prose(lines: list[str], width: int) -> list[str]:
    lead = lines[0][:len(lines[0]) - len(lines[0].lstrip())]
    import textwrap

    return textwrap.wrap(" ".join(x.strip() for x in lines), width, initial_indent=lead,
                         subsequent_indent=lead, break_long_words=False, break_on_hyphens=False)


def _fit_block(lines: list[str], width: int) -> list[str]:
    out: list[str] = []
    prose: list[str] = []

    def flush() -> None:
        if prose:
            out.extend(_wrap_prose(prose, width) if any(len(x) > width for x in prose) else prose)
            prose.clear()

    in_command = False
    for line in lines:
        continued = in_command
        is_command = in_command or line.strip().startswith("kvtool ")
        in_command = is_command and line.rstrip().endswith("\\")
        if is_command or _is_table(line):
            flush()
            if len(line) <= width:
                out.append(line)
            elif is_command:
                out.extend(_wrap_command(line, width, continued))
            else:
                out.extend(_wrap_table(line, width))
        else:
            prose.append(line)
    flush()
    return out


def fit_text(text: str, width: int) -> str:
    """``text`` (help or epilog, dedented) with the lines of its ``\\b`` blocks that are
    wider than ``width`` rewrapped (see the module docstring)."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.splitlines()
        if lines and lines[0].strip() == "\b":
            lines = [lines[0], *_fit_block(lines[1:], width)]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _write(formatter: click.HelpFormatter, text: str) -> None:
    formatter.write_paragraph()
    with formatter.indentation():
        formatter.write_text(fit_text(text, formatter.width - formatter.current_indent))


def fit_help(cmd: click.Command) -> None:
    """Make ``cmd`` (and its sub-commands) print its help text and epilog rewrapped to the
    formatter's width."""

    def format_help_text(ctx: click.Context, formatter: click.HelpFormatter) -> None:
        text = inspect.cleandoc(cmd.help).partition("\f")[0] if cmd.help else ""
        if cmd.deprecated:
            text += " (Deprecated)"
        if text:
            _write(formatter, text)

    def format_epilog(ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if cmd.epilog:
            _write(formatter, inspect.cleandoc(cmd.epilog))

    patched: Any = cmd
    patched.format_help_text = format_help_text
    patched.format_epilog = format_epilog
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            fit_help(sub)
