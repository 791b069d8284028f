"""``kvtool load`` through a two-path URL while ``kvtool target ana`` flips the listeners'
states back and forth and the listener carrying the I/O dies for a second (issue 21's
"Done when"), against any target that ``kvtool target ana`` drives.

:func:`load_through_faults` returns the load's report, the faults with their failover
times, and asserts what must hold: the load wrote everything, every fault during it was
followed by an I/O completed on the other path within 5 s, and ``kvtool verify`` is clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import REPO, run, run_json


def faults_during(argv: list[str], name: str, p1: int, p2: int, out: Path, *,
                  kill: Callable[[str], None], revive: Callable[[str], None], group: int = 1,
                  rounds: int = 6, set_state: Callable[[str, str], None] | None = None,
                  warmup: float = 0.5) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """Run ``kvtool --json ARGV`` (its JSON to ``out``) while faults happen on target
    ``name``'s listeners 127.0.0.1:p1 (optimized at the start, carrying the I/O) and p2
    (non-optimized), for the namespace's ANA ``group``: ``rounds`` flips of the optimized
    path to inaccessible (the other becomes optimized), and halfway ``kill(addr)`` of the
    listener carrying the I/O, ``revive(addr)`` a second later. The faults start ``warmup``
    seconds after the command. ``set_state(addr, state)`` replaces ``kvtool target ana``
    for the flips (a QEMU guest's kvtool takes seconds to start: there the test writes
    configfs directly). Returns (the command's JSON, the faults with wall-clock start/end,
    the time the command ended); asserts it exited 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "kvtool", "--json", *argv], env=env,
                                stdout=sink, stderr=subprocess.PIPE, text=True)
    faults: list[dict[str, Any]] = []  # what, path, start, end (wall clock)
    flip_errors: list[str] = []
    stop = threading.Event()

    def flip(listener: str, state: str) -> None:
        if set_state is not None:
            set_state(listener, state)
            return
        r = run("target", "ana", "--name", name, "--listener", listener, "--group", str(group),
                "--state", state)
        if r.exit_code != 0:
            flip_errors.append(r.stderr)

    def fault(what: str, path: str, act: Callable[[], None]) -> None:
        t0 = time.time()
        act()
        faults.append({"what": what, "path": path, "start": t0, "end": time.time()})

    def injector() -> None:
        a, b = f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"  # a: optimized (carries I/O), b: not
        time.sleep(warmup)  # the command has connected both paths and does I/O
        for i in range(rounds):
            if stop.is_set():
                return
            if i == rounds // 2:  # the listener carrying the I/O dies for a second
                fault("kill listener", a, lambda a=a: kill(a))  # type: ignore[misc]
                time.sleep(1.0)
                revive(a)
                # The host failed over to b, and may or may not go back to the revived a.
                # So that the next flip takes the path that carries the I/O, the I/O is
                # put on b: b optimized, a inaccessible for a moment (the host leaves it
                # if it went back), then non-optimized. Not a fault: nothing checks it.
                flip(b, "optimized")
                flip(a, "inaccessible")
                time.sleep(0.3)
                flip(a, "non-optimized")
                a, b = b, a
                time.sleep(0.3)
                continue
            flip(b, "optimized")
            fault("flip to inaccessible", a, lambda a=a: flip(a, "inaccessible"))  # type: ignore[misc]
            time.sleep(0.3)
            flip(a, "non-optimized")
            a, b = b, a

    t = threading.Thread(target=injector)
    t.start()
    try:
        _, err = proc.communicate(timeout=600)
        ended = time.time()
    finally:
        stop.set()
        t.join(120)
    assert proc.returncode == 0, err
    assert flip_errors == [], flip_errors
    return json.loads(out.read_text()), faults, ended


def load_through_faults(name: str, p1: int, p2: int, nqn: str, out: Path, *,
                        kill: Callable[[str], None], revive: Callable[[str], None],
                        count: int = 12000, object_bytes: str = "16KiB",
                        group: int = 1, qd: int = 2, rounds: int = 6,
                        set_state: Callable[[str, str], None] | None = None,
                        warmup: float = 0.5) -> dict[str, Any]:
    """``kvtool load`` of ``count`` objects through ``127.0.0.1:p1,127.0.0.1:p2`` during
    :func:`faults_during`'s faults; then ``kvtool verify``."""
    url = f"nvme+tcp://127.0.0.1:{p1},127.0.0.1:{p2}/{nqn}/1"
    doc, faults, load_end = faults_during(
        ["load", url, "--block-bytes", object_bytes, "--count", str(count), "--qd", str(qd)],
        name, p1, p2, out, kill=kill, revive=revive, group=group, rounds=rounds,
        set_state=set_state, warmup=warmup)
    assert doc["written"] == count
    mp = doc["engine"]["multipath"]
    # each fault while the load ran: the first I/O completed on another path, timed from
    # the start of the fault's command (an upper bound: the fault lands within it)
    timed = []
    for f in faults:
        # the command's last data I/O comes before its exit by its final commit, the
        # paths' disconnects and the interpreter's shutdown: a fault in that tail is not
        # followed by any I/O, so it has no failover to show
        if f["end"] > load_end - 0.5:
            continue
        after = [x for x in mp["failovers"]
                 if x["from"] == f["path"] and x["completed_at"] >= f["start"]]
        assert after, (f, faults, mp["failovers"])
        timed.append({**f, "failover_s": after[0]["completed_at"] - f["start"],
                      "detected_to_completed_s": after[0]["failover_s"]})
    assert len(timed) >= 3 and any(f["what"] == "kill listener" for f in timed), (
        f"load ran {doc['seconds']:.1f} s, ended at {load_end}; faults: {faults}")
    assert all(f["failover_s"] < 5 for f in timed), timed
    verify = run_json("verify", url)
    assert verify["ok"] is True and verify["bad"] == [], verify
    assert verify["objects_checked"] == verify["content_checked"] == count
    summary = {"load_seconds": doc["seconds"], "written": doc["written"],
               "verified": verify["objects_checked"], "faults": timed,
               "retried_requests": mp["retried_requests"], "paths": mp["paths"]}
    print(json.dumps(summary, indent=1))
    return summary
