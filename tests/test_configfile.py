"""kvtool.configfile: the one reader of config files; every error names file, line and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.configfile import (
    JsonLocator,
    TomlLocator,
    field_name,
    parse_config_text,
    parse_field_name,
    read_config,
)
from kvtool.errors import InputError


def test_json_locator_follows_objects_and_arrays() -> None:
    text = ('{\n  "listen": ["127.0.0.1:4420",\n     "[::1]:4420"],\n  "subsystems": [\n'
            '    {"nqn": "a",\n     "namespaces": [{"nsid": 1}, {"nsid": 2,\n'
            '        "backing": "x"}]},\n    {"nqn": "b"}\n  ]\n}')
    loc = JsonLocator(text)
    assert loc.line(("listen", 1)) == 3
    assert loc.line(("subsystems", 0, "namespaces", 1, "backing")) == 7
    assert loc.line(("subsystems", 1, "nqn")) == 8
    assert loc.line(("subsystems", 1, "unknown")) == 8  # falls back to the enclosing table


def test_toml_locator_respects_tables() -> None:
    loc = TomlLocator('capacity = 1\n[dram]\ncapacity = 2\n[[x]]\ncapacity = 3\n[[x]]\n'
                      'capacity = 4\n')
    assert [loc.line(p) for p in (("capacity",), ("dram", "capacity"), ("x", 0, "capacity"),
                                  ("x", 1, "capacity"))] == [1, 3, 5, 7]


def test_field_names_round_trip() -> None:
    path = ("subsystem", 0, "namespace", 12, "nsid")
    assert field_name(path) == "subsystem[0].namespace[12].nsid"
    assert parse_field_name(field_name(path)) == path


@pytest.mark.parametrize(("text", "kind", "line"), [("a = 1\nb = \n", "toml", 2),
                                                    ('{\n"a": 1,\n}', "json", 3)])
def test_syntax_errors_name_the_line(text: str, kind: str, line: int) -> None:
    with pytest.raises(InputError) as err:
        parse_config_text(text, source="f", kind=kind)  # type: ignore[arg-type]
    assert (err.value.file, err.value.line) == ("f", line)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        read_config(tmp_path / "none.toml")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(InputError, match="not UTF-8"):
        read_config(tmp_path / "bin.toml")


def test_every_reader_names_file_line_and_key(tmp_path: Path) -> None:
    from emulator.nvmetcp.config import EmulatorConfig as EmulatorConfig
    from kvtool.replay.config import load_tiers_file

    tiers = tmp_path / "tiers.toml"
    tiers.write_text('[gpu]\ncapacity = "1GiB"\n[dram]\ncapacity = "1GiB"\npolicy = "nope"\n')
    with pytest.raises(InputError) as err:
        load_tiers_file(tiers)
    assert (err.value.file, err.value.line, err.value.field) == (str(tiers), 5, "dram.policy")

    emu = tmp_path / "emu.json"
    emu.write_text(json.dumps({"listen": ["127.0.0.1:0"], "subsystems": [
        {"nqn": "nqn.2026-01.io.kvtool:a", "allow_any_host": True,
         "namespaces": [{"nsid": 1, "backing": "1MiB"}]},
        {"nqn": "nqn.2026-01.io.kvtool:b", "allow_any_host": True,
         "namespaces": [{"nsid": 1, "backing": "1MiB", "colour": "red"}]}]}, indent=2))
    with pytest.raises(InputError) as err:
        EmulatorConfig.load(emu)
    lines = emu.read_text().splitlines()
    assert err.value.field == "subsystems[1].namespaces[0].colour"
    assert err.value.line is not None and '"colour"' in lines[err.value.line - 1]
