"""Config loading: every mistake names the file, the line and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.configfile import TomlLocator as Locator
from kvtool.errors import InputError
from kvtool.nvme.spec import nqn_problem
from kvtool.target.loader import load_config, parse_config
from tests.conftest import FIXTURES

HOST = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-4111-8111-111111111111"

GOOD = f"""backend = "emulator"
name = "t"
[emulator]
runtime = "userspace"
[[subsystem]]
nqn = "nqn.2026-01.io.kvtool:a"
hosts = ["{HOST}"]
  [[subsystem.namespace]]
  nsid = 1
  size = "64MiB"
  [[subsystem.namespace]]
  nsid = 2
  size = "32MiB"
  lba = 4096
[[listener]]
address = "127.0.0.1"
port = 4420
"""


def err(text: str, **kw: object) -> InputError:
    with pytest.raises(InputError) as info:
        parse_config(text, source="t.toml", **kw)  # type: ignore[arg-type]
    return info.value


def test_good_config_parses() -> None:
    cfg = parse_config(GOOD, source="t.toml")
    assert cfg.name == "t" and cfg.runtime == "userspace"
    ns = cfg.subsystems[0].namespaces
    assert [(n.nsid, n.backing, n.size, n.block_size) for n in ns] == [
        (1, "memory", 64 << 20, 512), (2, "memory", 32 << 20, 4096)]
    assert cfg.listeners[0].subsystems == ("nqn.2026-01.io.kvtool:a",)
    assert cfg.listeners[0].id == 1 and cfg.listeners[0].family == "ipv4"
    assert parse_config(GOOD).digest() == cfg.digest()  # the source does not count


@pytest.mark.parametrize("fixture", sorted((FIXTURES / "targets").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_fixture_is_valid(fixture: Path) -> None:
    cfg = load_config(fixture, allow_remote=True, check_paths=False)
    assert cfg.subsystems


def test_unknown_key_names_line_and_key() -> None:
    e = err(GOOD.replace("  lba = 4096", "  lba = 4096\n  lab = 512"))
    assert (e.file, e.line, e.field) == ("t.toml", 15, "subsystem[0].namespace[1].lab")
    assert "unknown key 'lab'" in e.message and "lba" in e.message
    assert str(e).startswith("t.toml:15: field 'subsystem[0].namespace[1].lab': unknown key")


def test_duplicate_nsid() -> None:
    e = err(GOOD.replace("nsid = 2", "nsid = 1"))
    assert (e.line, e.field) == (12, "subsystem[0].namespace[1].nsid")
    assert "duplicate NSID 1" in e.message


def test_port_clash() -> None:
    e = err(GOOD + '[[listener]]\naddress = "127.0.0.1"\nport = 4420\n')
    assert (e.line, e.field) == (20, "listener[1].port")
    assert "port clash" in e.message


def test_backing_path_missing(tmp_path: Path) -> None:
    text = GOOD.replace('  size = "64MiB"', f'  path = "{tmp_path}/nope.img"')
    e = err(text)
    assert (e.line, e.field) == (10, "subsystem[0].namespace[0].path")
    assert "does not exist" in e.message and "create = true" in e.message
    # with create = true and a size it is fine, and nothing is created by loading
    ok = text.replace(f'  path = "{tmp_path}/nope.img"',
                      f'  path = "{tmp_path}/nope.img"\n  create = true\n  size = "1MiB"')
    parse_config(ok, source="t.toml")
    assert not (tmp_path / "nope.img").exists()


def test_address_not_local_needs_allow_remote() -> None:
    text = GOOD.replace('address = "127.0.0.1"', 'address = "0.0.0.0"')
    e = err(text)
    assert (e.line, e.field) == (16, "listener[0].address")
    assert "allow_remote" in e.message  # the library names its parameter; the CLI its flag
    parse_config(text, allow_remote=True)


@pytest.mark.parametrize("nqn", ["nqn.2026-13.io.kvtool:a", "iqn.2026-01.io.kvtool:a",
                                 "nqn.2026-01.-bad:a", "nqn.2026-01.io.kvtool:" + "x" * 220,
                                 "nqn.2014-08.org.nvmexpress.discovery"])
def test_bad_nqn(nqn: str) -> None:
    e = err(GOOD.replace("nqn.2026-01.io.kvtool:a", nqn))
    assert (e.line, e.field) == (6, "subsystem[0].nqn")


def test_nqn_forms() -> None:
    assert nqn_problem(HOST) is None
    assert nqn_problem("nqn.2016-06.io.spdk:cnode1") is None
    assert nqn_problem("nqn.2016-06.io.spdk:")
    assert nqn_problem("nqn.16-06.io.spdk:x")


def test_hosts_must_be_listed() -> None:
    e = err(GOOD.replace(f'hosts = ["{HOST}"]\n', ""))
    assert e.field == "subsystem[0].hosts" and "no host may connect" in e.message
    e = err(GOOD.replace(f'hosts = ["{HOST}"]', f'hosts = ["{HOST}"]\nallow_any_host = true'))
    assert e.field == "subsystem[0].allow_any_host" and "mutually exclusive" in e.message
    ok = parse_config(GOOD.replace(f'hosts = ["{HOST}"]', "allow_any_host = true"))
    assert ok.subsystems[0].allow_any_host
    e = err(GOOD.replace(f'hosts = ["{HOST}"]', 'hosts = ["host1"]'))
    assert (e.line, e.field) == (7, "subsystem[0].hosts[0]")


def test_local_host_token_resolves_to_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST.replace("1111-4111", "2222-4222"))
    cfg = parse_config(GOOD.replace(f'hosts = ["{HOST}"]', 'hosts = ["@local"]'))
    assert cfg.subsystems[0].hosts == (HOST.replace("1111-4111", "2222-4222"),)


@pytest.mark.parametrize("change,line,field,words", [
    ('  size = "64MiB"', 10, "subsystem[0].namespace[0].size", "unknown unit"),
    ("  lba = 4096", 14, "subsystem[0].namespace[1].lba", "512 or 4096"),
    ("port = 4420", 17, "listener[0].port", "out of range"),
    ('backend = "emulator"', 1, "backend", "expected one of"),
    ('address = "127.0.0.1"', 16, "listener[0].address", "IPv4 or IPv6"),
])
def test_bad_values(change: str, line: int, field: str, words: str) -> None:
    bad = {'  size = "64MiB"': '  size = "64 lightyears"', "  lba = 4096": "  lba = 1024",
           "port = 4420": "port = 70000", 'backend = "emulator"': 'backend = "iscsi"',
           'address = "127.0.0.1"': 'address = "localhost"'}[change]
    e = err(GOOD.replace(change, bad))
    assert (e.line, e.field) == (line, field)
    assert words in e.message


def test_toml_syntax_error_has_the_line() -> None:
    e = err(GOOD.replace("nsid = 2", "nsid = = 2"))
    assert e.line == 12 and "invalid TOML" in e.message


def test_backend_specific_checks() -> None:
    e = err(GOOD.replace('backend = "emulator"', 'backend = "nvmet"'))
    assert e.field == "subsystem[0].namespace[0].backing" and "nvmet backend cannot serve" in e.message
    e = err(GOOD + '[[transport]]\ntype = "tcp"\nio_unit_size = 8192\n')
    assert e.field == "transport[0]" and "SPDK transport options" in e.message


def test_listener_must_name_a_subsystem() -> None:
    e = err(GOOD + 'subsystems = ["nqn.2026-01.io.kvtool:zzz"]\n')
    assert (e.line, e.field) == (18, "listener[0].subsystems[0]")


def test_missing_file() -> None:
    with pytest.raises(InputError, match="no such file"):
        load_config("/nonexistent/target.toml")


def test_locator_maps_nested_arrays_of_tables() -> None:
    loc = Locator(GOOD + 'hosts2 = [\n  "a",\n  "b",\n]\n')
    assert loc.line(("subsystem", 0, "namespace", 1, "lba")) == 14
    assert loc.line(("subsystem", 0, "namespace", 0)) == 8
    assert loc.line(("listener", 0, "port")) == 17
    assert loc.line(("listener", 0, "hosts2", 1)) == 20
    assert loc.line(("subsystem", 0, "namespace", 0, "nothing")) == 8  # nearest table


@pytest.mark.parametrize(("nqn", "ok"), [
    ("nqn.2026-01.io.kvtool:a", True), ("nqn.2016-06.io.spdk:cnode1", True), (HOST, True),
    ("nqn.2026-01.io.kvtool", True), ("nqn.2026-01.io.kvtool:a b", True),
    ("nqn.2026-13.io.kvtool:a", False), ("nqn.16-06.io.spdk:x", False),
    ("nqn.2026-01.-bad:a", False), ("nqn.2026-01.io.kvtool:", False),
    ("nqn.2026-01.io.kvtool:" + "x" * 210, False), ("iqn.2026-01.io.kvtool:a", False),
])
def test_one_nqn_rule_everywhere(nqn: str, ok: bool) -> None:
    """The config loader, nvme+tcp:// URLs and the emulator's config accept the same NQNs."""
    from emulator.nvmetcp.config import simple_config
    from kvtool.errors import UsageError
    from kvtool.nvme.url import parse_nvme_url

    verdicts = {"spec": nqn_problem(nqn) is None}
    try:
        parse_config(GOOD.replace("nqn.2026-01.io.kvtool:a", nqn), source="t.toml")
        verdicts["loader"] = True
    except InputError:
        verdicts["loader"] = False
    try:
        parse_nvme_url(f"nvme+tcp://127.0.0.1:4420/{nqn}/1")
        verdicts["url"] = True
    except UsageError:
        verdicts["url"] = False
    try:
        simple_config(nqn=nqn, backing="1MiB", allow_any_host=True)
        verdicts["emulator"] = True
    except InputError:
        verdicts["emulator"] = False
    assert verdicts == dict.fromkeys(verdicts, ok)


def test_one_loopback_rule() -> None:
    from kvtool.nvme.spec import is_loopback

    assert all(is_loopback(a) for a in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(a) for a in ("0.0.0.0", "192.168.1.10", "::", "example.com"))


def test_busy_poll_is_a_userspace_runtime_setting() -> None:
    from kvtool.target.document import config_document

    text = GOOD.replace('runtime = "userspace"', 'runtime = "userspace"\nbusy_poll_us = 0')
    cfg = parse_config(text, source="t.toml")
    assert cfg.busy_poll_us == 0
    assert parse_config(GOOD).busy_poll_us is None
    assert cfg.digest() != parse_config(GOOD).digest()  # a changed setting restarts it
    assert config_document(cfg)["emulator"]["busy_poll_us"] == 0
    assert "busy_poll_us" not in config_document(parse_config(GOOD))["emulator"]
    e = err(text.replace("busy_poll_us = 0", "busy_poll_us = 2000000"))
    assert (e.line, e.field) == (5, "emulator.busy_poll_us") and "out of range" in e.message
    e = err(text.replace('runtime = "userspace"', 'runtime = "kernel"'))
    assert e.field == "emulator.busy_poll_us" and "userspace runtime only" in e.message


def test_engine_is_the_deprecated_name_of_runtime(caplog: pytest.LogCaptureFixture) -> None:
    """Files written before the rename keep working: ``[emulator] engine`` is read as
    ``runtime``, with one warning naming the file and line; both keys is an error."""
    old = GOOD.replace('runtime = "userspace"', 'engine = "kernel"')
    with caplog.at_level("WARNING", logger="kvtool.target"):
        cfg = parse_config(old, source="t.toml")
    assert cfg.runtime == "kernel"
    assert [r.getMessage() for r in caplog.records] == [
        "t.toml:4: [emulator] engine is deprecated: call it runtime (same values)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvtool.target"):
        assert parse_config(GOOD, source="t.toml").runtime == "userspace"
    assert not caplog.records
    e = err(GOOD.replace('runtime = "userspace"', 'runtime = "userspace"\nengine = "qemu"'))
    assert (e.line, e.field) == (5, "emulator.engine") and "runtime only" in e.message
    e = err(GOOD.replace('runtime = "userspace"', 'engine = "diesel"'))
    assert e.field == "emulator.engine" and "expected one of" in e.message


def test_records_written_before_the_rename_are_read(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A target brought up by an older kvtool (``engine``, ``extra.engine_config``) is
    still found by ``status`` and ``down``: its record reads with today's keys."""
    import json
    from dataclasses import asdict

    from kvtool.target import procs, state

    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path))
    new = state.TargetState(name="old", backend="emulator", runtime="userspace",
                            config_path=None, config_text="{}", config_format="json",
                            digest="d", extra={"runtime_config": "{}", "log": "x"})
    doc = new.to_json()
    doc["engine"] = doc.pop("runtime")
    doc["extra"] = {"engine_config": "{}", "log": "x"}
    state.targets_dir().mkdir(parents=True)
    (state.targets_dir() / "old.json").write_text(json.dumps(doc))
    assert state.load("old") == new
    rec = procs.ProcessRecord(target="old", backend="emulator", runtime="userspace", role="r",
                              token="t")
    procs.processes_dir().mkdir(parents=True)
    old_rec = asdict(rec)
    old_rec["engine"] = old_rec.pop("runtime")
    (procs.processes_dir() / "r.json").write_text(json.dumps(old_rec))
    assert [r.runtime for r in procs.records("old")] == ["userspace"]
