"""ANA end to end with the CLI (issue 21, part 2): a target with two listeners
(fixtures/targets/multipath.toml on free ports), ``kvtool target ana`` flipping states at
run time, ``kvtool target status`` showing them, and ``kvtool load`` through the two-path
URL while the states flip back and forth and one listener dies: 0 errors, ``kvtool
verify`` clean, every failover timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtool.target import procs
from kvtool.target import state as st
from tests.conftest import FIXTURES, REPO, free_port, run, run_json

HOST = "nqn.2014-08.org.nvmexpress:uuid:21212121-2121-4121-8121-2121212121a5"
NQN = "nqn.2026-01.io.kvtool:multipath"


@pytest.fixture
def multipath(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, int, int]]:
    monkeypatch.setenv("KVTOOL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KVTOOL_HOSTNQN", HOST)
    p1, p2 = free_port(), free_port()
    text = (FIXTURES / "targets" / "multipath.toml").read_text()
    text = text.replace("port = 4420", f"port = {p1}").replace("port = 4421", f"port = {p2}")
    cfg = tmp_path / "multipath.toml"
    cfg.write_text(text)
    yield cfg, p1, p2
    for name in st.names():
        run("target", "down", "--name", name)
    for rec in procs.records():
        procs.stop(rec, timeout=5)


def ana_of(status: dict[str, Any], port: int) -> dict[str, str]:
    [sub] = status["subsystems"]
    return dict(next(x["ana"] for x in sub["listeners"] if x["port"] == port))


@pytest.mark.integration
def test_target_ana_flips_a_state_and_status_shows_it(multipath: tuple[Path, int, int]) -> None:
    cfg, p1, p2 = multipath
    up = run_json("target", "up", str(cfg))
    assert ana_of(up["status"], p1) == {"1": "optimized"}
    assert ana_of(up["status"], p2) == {"1": "non-optimized"}
    [ns] = up["status"]["subsystems"][0]["namespaces"]
    assert ns["multipath_url"] == f"nvme+tcp://127.0.0.1:{p1},127.0.0.1:{p2}/{NQN}/1"
    # the examples of `kvtool target ana --help`, on this target's ports
    flip = run_json("target", "ana", str(cfg), "--listener", f"127.0.0.1:{p2}", "--state",
                    "inaccessible")
    assert (flip["previous"], flip["state"], flip["group"]) == ("non-optimized", "inaccessible", 1)
    again = run("target", "ana", "--name", "multipath", "--listener", f"127.0.0.1:{p1}",
                "--group", "1", "--state", "optimized")
    assert again.exit_code == 0 and "optimized -> optimized" in again.stdout
    status = run_json("target", "status")
    assert ana_of(status, p2) == {"1": "inaccessible"} and ana_of(status, p1) == {"1": "optimized"}
    human = run("target", "status")
    assert f"127.0.0.1:{p2} (ANA g1 inaccessible)" in human.stdout.replace("\n", " ") or \
        "g1 inaccessible" in human.stdout
    # up with the same file is a no-op: the run-time state stays
    assert run_json("target", "up", str(cfg))["applied"] == 0
    assert ana_of(run_json("target", "status"), p2) == {"1": "inaccessible"}
    bad = run("target", "ana", str(cfg), "--listener", "127.0.0.1:9", "--state", "optimized")
    assert bad.exit_code == 2 and "has no listener 127.0.0.1:9" in bad.stderr
    bad = run("target", "ana", str(cfg), "--listener", f"127.0.0.1:{p1}", "--state", "sideways")
    assert bad.exit_code == 2
    run_json("target", "down", str(cfg))
    gone = run("target", "ana", str(cfg), "--listener", f"127.0.0.1:{p1}", "--state", "optimized")
    assert gone.exit_code == 2 and "is not up" in gone.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_load_through_two_paths_while_states_flip_and_a_listener_dies(
        multipath: tuple[Path, int, int], tmp_path: Path) -> None:
    cfg, p1, p2 = multipath
    run_json("target", "up", str(cfg))
    url = f"nvme+tcp://127.0.0.1:{p1},127.0.0.1:{p2}/{NQN}/1"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "load.json"
    with open(out, "w") as sink:
        load = subprocess.Popen([sys.executable, "-m", "kvtool", "--json", "load", url,
                                 "--block-bytes", "16KiB", "--count", "12000", "--qd", "2"],
                                env=env, stdout=sink, stderr=subprocess.PIPE, text=True)
    faults: list[dict[str, Any]] = []  # what, path, start, end (wall clock)
    flip_errors: list[str] = []
    stop = threading.Event()

    def flip(listener: str, state: str) -> None:
        r = run("target", "ana", "--name", "multipath", "--listener", listener, "--state", state)
        if r.exit_code != 0:
            flip_errors.append(r.stderr)

    def fault(what: str, path: str, act: Callable[[], None]) -> None:
        t0 = time.time()
        act()
        faults.append({"what": what, "path": path, "start": t0, "end": time.time()})

    def flipper() -> None:
        from kvtool.target import api
        cfg_now, record = api.resolve(None, "multipath")
        engine = api.backend_for(cfg_now, None, record)
        listener = {f"127.0.0.1:{x.port}": x for x in cfg_now.listeners}
        a, b = f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"  # a: optimized, b: non-optimized
        for i in range(6):
            if stop.is_set():
                return
            if i == 3:  # the listener carrying the I/O dies for a second
                fault("kill listener", a,
                      lambda a=a: engine.set_closed(  # type: ignore[attr-defined,misc]
                          cfg_now, [listener[a]]))
                time.sleep(1.0)
                engine.set_closed(cfg_now, [])  # type: ignore[attr-defined]
                time.sleep(0.3)
                continue
            flip(b, "optimized")
            fault("flip to inaccessible", a,
                  lambda a=a: flip(a, "inaccessible"))  # type: ignore[misc]
            time.sleep(0.3)
            flip(a, "non-optimized")
            a, b = b, a

    t = threading.Thread(target=flipper)
    t.start()
    try:
        _, err = load.communicate(timeout=300)
        load_end = time.time()
    finally:
        stop.set()
        t.join(60)
    assert load.returncode == 0, err
    doc = json.loads(out.read_text())
    assert doc["written"] == 12000
    mp = doc["engine"]["multipath"]
    # each fault while the load ran: the first I/O completed on another path, timed from
    # the start of the fault's command (an upper bound: the fault lands within it)
    timed = []
    for f in faults:
        if f["end"] > load_end - 0.2:
            continue
        after = [x for x in mp["failovers"]
                 if x["from"] == f["path"] and x["completed_at"] >= f["start"]]
        assert after, (f, mp["failovers"])
        timed.append({**f, "failover_s": after[0]["completed_at"] - f["start"],
                      "detected_to_completed_s": after[0]["failover_s"]})
    assert len(timed) >= 3 and any(f["what"] == "kill listener" for f in timed), timed
    assert all(f["failover_s"] < 5 for f in timed), timed
    verify = run_json("verify", url)
    assert verify["ok"] is True and verify["bad"] == [], verify
    assert verify["objects_checked"] == verify["content_checked"] == 12000
    assert flip_errors == []
    print(json.dumps({"load_seconds": doc["seconds"], "written": doc["written"],
                      "faults": timed, "retried_requests": mp["retried_requests"],
                      "paths": mp["paths"]}, indent=1))
