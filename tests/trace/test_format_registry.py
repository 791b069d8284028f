"""The trace-format registry (kvtool/trace/formats/__init__.py): one reader module per
format, one registration each; every ``--format`` and ``convert --to`` choice comes from
it (docs/architecture.md, "Where to add…")."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvtool.cli.main import cli
from kvtool.trace.formats import FALLBACK, TRACE_FORMATS, format_module
from kvtool.trace.formats.lines import LineParser
from kvtool.trace.schema import DEFAULT_BLOCK_TOKENS, FORMATS, WRITABLE
from tests.conftest import REPO


@pytest.mark.parametrize("name", list(TRACE_FORMATS))
def test_every_registered_format_opens_its_reader(name: str) -> None:
    entry = TRACE_FORMATS[name]
    assert (REPO / "kvtool" / "trace" / "formats" / f"{entry.module}.py").exists()
    module = format_module(name)
    assert issubclass(module.Parser, LineParser)
    parser = module.Parser("t", entry.default_block_tokens, explicit_block_tokens=None,
                           block_tokens_source="the default")
    assert parser.block_tokens == DEFAULT_BLOCK_TOKENS[name] > 0
    if entry.header:  # known by its first line: the module says which
        assert module.Parser.wants_header and callable(module.is_header)
    assert name in FORMATS and (name in WRITABLE) == entry.writable


def test_auto_detection_has_a_fallback_and_keys_are_not_shared() -> None:
    assert FALLBACK in TRACE_FORMATS
    keyed = [f.keys for f in TRACE_FORMATS.values() if f.keys]
    assert not any(a & b for i, a in enumerate(keyed) for b in keyed[i + 1:])


def test_the_commands_take_their_choices_from_the_registry() -> None:
    assert ("auto", *TRACE_FORMATS) == FORMATS
    replay = CliRunner().invoke(cli, ["replay", "--help"], terminal_width=200).output
    assert "[" + "|".join(FORMATS) + "]" in replay
    convert = CliRunner().invoke(cli, ["trace", "convert", "--help"], terminal_width=200).output
    assert "[" + "|".join(WRITABLE) + "]" in convert
