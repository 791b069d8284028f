"""``python -m emulator.nvmetcp``: ready line, --ready-file, SIGTERM flush, bad input, --config."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from emulator.nvmetcp.config import EmulatorConfig
from kvtool.errors import InputError
from kvtool.nvme import host
from tests.conftest import REPO

NQN = "nqn.2026-01.io.kvtool:cli"
HOSTNQN = "nqn.2026-01.io.kvtool:cli-host"


def run_target(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "emulator.nvmetcp", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def bad(*args: str, cwd: Path = REPO) -> str:
    proc = subprocess.run([sys.executable, "-m", "emulator.nvmetcp", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 or lines[0].startswith("Usage:"), proc.stderr
    return proc.stderr


@pytest.mark.integration
def test_ready_line_ready_file_and_sigterm_flush(tmp_path: Path) -> None:
    backing = tmp_path / "ns.img"
    ready = tmp_path / "ready.json"
    proc = run_target("--listen", "127.0.0.1:0", "--nqn", NQN, "--backing", str(backing),
                      "--size", "4MiB", "--lba", "4096", "--host", HOSTNQN,
                      "--ready-file", str(ready))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        word, url = line.split(" ")
        assert word == "ready" and url.startswith("nvme+tcp://127.0.0.1:") and url.endswith(NQN)
        record = json.loads(ready.read_text())
        assert record["urls"] == [url] and record["pid"] == proc.pid
        assert record["discovery"].endswith("nqn.2014-08.org.nvmexpress.discovery")
        port = int(url.split(":")[2].split("/")[0])
        with host.connect("127.0.0.1", port, NQN, hostnqn=HOSTNQN) as ctrl:
            assert ctrl.identify_namespace(1).lba_size == 4096
            ctrl.write(1, 5, b"\x5a" * 4096)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert proc.returncode == 0
    assert backing.stat().st_size == 4 << 20
    assert backing.read_bytes()[5 * 4096: 6 * 4096] == b"\x5a" * 4096


def test_bad_options_one_line_exit_2(tmp_path: Path) -> None:
    assert "--host" in bad("--nqn", NQN, "--backing", "1MiB")  # no host may connect
    assert "--backing" in bad("--nqn", NQN, "--backing", "lots", "--allow-any-host")
    assert "--nqn" in bad("--nqn", "iqn.bad", "--backing", "1MiB", "--allow-any-host")
    assert "allow-remote" in bad("--nqn", NQN, "--backing", "1MiB", "--allow-any-host",
                                 "--listen", "0.0.0.0:4420")
    assert "--mdts" in bad("--nqn", NQN, "--backing", "1MiB", "--allow-any-host", "--mdts", "40")
    assert "--busy-poll" in bad("--nqn", NQN, "--backing", "1MiB", "--allow-any-host",
                                "--busy-poll", "-5")
    cfg = tmp_path / "t.json"
    cfg.write_text(json.dumps({"subsystems": [{"nqn": NQN, "namespaces": [
        {"nsid": 1, "backing": "1MiB", "lba_size": 1024}]}]}))
    err = bad("--config", str(cfg))
    assert "t.json" in err and "subsystems[0].namespaces[0].lba_size" in err
    assert "field '--backing'" in bad("--nqn", NQN, "--backing", str(tmp_path),
                                      "--allow-any-host")  # a directory
    assert "field '--size'" in bad("--nqn", NQN, "--backing", str(tmp_path / "n.img"),
                                   "--size", "0", "--allow-any-host")
    # sizes no machine has: one line, and no file left behind
    err = bad("--nqn", NQN, "--backing", "9000000TiB", "--allow-any-host")
    assert "field '--backing'" in err and "cannot reserve" in err
    err = bad("--nqn", NQN, "--backing", str(tmp_path / "huge.img"), "--size", "9000000TiB",
              "--allow-any-host")
    assert "field '--backing'" in err and "cannot size" in err
    assert not (tmp_path / "huge.img").exists()
    err = bad("--nqn", NQN, "--backing", "1MiB", "--allow-any-host", "--listen", "127.0.0.1:0",
              "--ready-file", str(tmp_path / "missing" / "ready.json"))
    assert "field '--ready-file'" in err and "cannot listen" not in err
    cfg.write_text(json.dumps({"subsystems": [{"nqn": NQN, "allow_any_host": True,
                                               "namespaces": [{"nsid": 1, "backing": "/dev/null"}]}]}))
    err = bad("--config", str(cfg))
    assert "t.json" in err and "subsystems[0].namespaces[0].backing" in err
    cfg.write_text(json.dumps({"kato_grace_s": -1, "subsystems": [
        {"nqn": NQN, "allow_any_host": True, "namespaces": [{"nsid": 1, "backing": "1MiB"}]}]}))
    assert "field 'kato_grace_s'" in bad("--config", str(cfg))
    # a memory size plus "size" (file creation) is refused, not created as a file named 1MiB
    cfg.write_text(json.dumps({"subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
        {"nsid": 1, "backing": "1MiB", "size": "2MiB"}]}]}))
    err = bad("--config", str(cfg), cwd=tmp_path)
    assert "subsystems[0].namespaces[0].size" in err and not (tmp_path / "1MiB").exists()


def test_config_schema(tmp_path: Path) -> None:
    doc = {
        "listen": ["127.0.0.1:0"], "mdts": 5, "max_queue_size": 64,
        "subsystems": [
            {"nqn": NQN, "hosts": [HOSTNQN], "serial": "SN1", "model": "M",
             "namespaces": [{"nsid": 1, "backing": "1MiB"},
                            {"nsid": 2, "backing": str(tmp_path / "f.img"), "size": "2MiB",
                             "lba_size": 4096}]},
            {"nqn": NQN + "2", "allow_any_host": True,
             "namespaces": [{"nsid": 1, "backing": "1MiB"}]},
        ]}
    cfg = EmulatorConfig.from_dict(doc, file="x.json")
    assert cfg.mdts == 5 and len(cfg.subsystems) == 2
    assert cfg.subsystems[0].namespaces[1].lba_size == 4096
    for broken, fld in [
        ({**doc, "mdts": "5"}, "mdts"),
        ({**doc, "extra": 1}, "extra"),
        ({**doc, "subsystems": [{"nqn": NQN}]}, "subsystems[0].namespaces"),
        ({**doc, "subsystems": [{"namespaces": []}]}, "subsystems[0].nqn"),
        ({**doc, "subsystems": [{"nqn": NQN, "allow_any_host": True, "hosts": [HOSTNQN],
                                 "namespaces": [{"nsid": 1, "backing": "1MiB"}]}]},
         "subsystems[0].allow_any_host"),
        ({**doc, "listen": ["10.1.2.3:4420"]}, "listen[0]"),
    ]:
        with pytest.raises(InputError) as info:
            EmulatorConfig.from_dict(broken, file="x.json")
        assert info.value.field == fld and info.value.file == "x.json"


@pytest.mark.integration
def test_config_file_serves_several_subsystems(tmp_path: Path) -> None:
    cfg = tmp_path / "target.json"
    cfg.write_text(json.dumps({
        "listen": ["127.0.0.1:0"],
        "subsystems": [
            {"nqn": NQN, "hosts": [HOSTNQN], "namespaces": [
                {"nsid": 1, "backing": "1MiB"}, {"nsid": 3, "backing": "2MiB"}]},
            {"nqn": NQN + "-b", "allow_any_host": True,
             "namespaces": [{"nsid": 1, "backing": "1MiB", "lba_size": 4096}]}]}))
    proc = run_target("--config", str(cfg))
    try:
        assert proc.stdout is not None
        urls = proc.stdout.readline().split()[1:]
        assert [u.rsplit("/", 1)[1] for u in urls] == [NQN, NQN + "-b"]
        port = int(urls[0].split(":")[2].split("/")[0])
        with host.connect("127.0.0.1", port, NQN, hostnqn=HOSTNQN) as ctrl:
            assert ctrl.active_namespaces() == [1, 3]
        entries = host.discover("127.0.0.1", port, hostnqn="nqn.2026-01.io.kvtool:other")
        assert [e.subnqn for e in entries] == [NQN + "-b"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert proc.returncode == 0
