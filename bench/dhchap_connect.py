#!/usr/bin/env python3
"""What DH-HMAC-CHAP costs a connection: kvtool host ↔ kvtool target on loopback.

Measured in the same run, the target in a separate process (``python -m emulator.nvmetcp``
with one host that must authenticate, bidirectionally):

* reference: connect + close of a controller (admin + ``--io-queues`` I/O queues) without
  authentication;
* the same with DH-HMAC-CHAP on every queue: SHA-256 + NULL, SHA-256 + FFDHE-2048,
  SHA-512 + FFDHE-4096, SHA-512 + FFDHE-8192 → the ratio to the reference;
* and one modular exponentiation per FFDHE group (Python's ``pow``), which each side does
  twice per queue.

Each round measures every case back to back, so a busy machine slows them alike; the
printed times and ratios are medians over rounds. Authentication is paid once per queue
per connection, never per I/O.

usage: python bench/dhchap_connect.py [--rounds 7] [--io-queues 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvtool.nvme import dhchap, host  # noqa: E402

NQN = "nqn.2026-01.io.kvtool:bench-auth"
OPEN_HOST = "nqn.2026-01.io.kvtool:bench-open"
CASES = [("sha256", "null"), ("sha256", "ffdhe2048"), ("sha512", "ffdhe4096"),
         ("sha512", "ffdhe8192")]


def _host(i: int) -> str:
    return f"nqn.2026-01.io.kvtool:bench-auth-{i}"


def _start(keydir: Path) -> tuple[subprocess.Popen[str], int]:
    cfg = {"listen": ["127.0.0.1:0"],
           "subsystems": [{"nqn": NQN, "namespaces": [{"nsid": 1, "backing": "16MiB"}],
                           "hosts": [OPEN_HOST, *(_host(i) for i in range(len(CASES)))]}],
           "host_keys": [{"nqn": _host(i), "dhchap_key_file": str(keydir / "host.key"),
                          "dhchap_ctrl_key_file": str(keydir / "ctrl.key"),
                          "dhchap_hashes": [h], "dhchap_dhgroups": [g]}
                         for i, (h, g) in enumerate(CASES)]}
    path = keydir / "target.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "emulator.nvmetcp", "--config", str(path)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        sys.exit(f"target did not start: {line!r}")
    return proc, int(line.split()[1].split("/")[2].rsplit(":", 1)[1])


def _connect_s(port: int, hostnqn: str, io_queues: int, secret: dhchap.Secret | None,
               ctrl: dhchap.Secret | None) -> float:
    t0 = time.perf_counter()
    with host.connect("127.0.0.1", port, NQN, hostnqn=hostnqn, io_queues=io_queues,
                      dhchap_secret=secret, dhchap_ctrl_secret=ctrl) as c:
        assert len(c.io) == io_queues and (secret is None or c.authenticated)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--io-queues", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        keydir = Path(d)
        secret, ctrl = dhchap.generate_secret(), dhchap.generate_secret()
        dhchap.write_secret_file(keydir / "host.key", secret)
        dhchap.write_secret_file(keydir / "ctrl.key", ctrl)
        proc, port = _start(keydir)
        times: dict[str, list[float]] = {"none": [], **{f"{h}/{g}": [] for h, g in CASES}}
        modexp: dict[str, list[float]] = {g: [] for _h, g in CASES if g != "null"}
        try:
            for _ in range(a.rounds):
                times["none"].append(_connect_s(port, OPEN_HOST, a.io_queues, None, None))
                for i, (h, g) in enumerate(CASES):
                    times[f"{h}/{g}"].append(_connect_s(port, _host(i), a.io_queues, secret,
                                                        ctrl))
                for g in modexp:
                    t0 = time.perf_counter()
                    dhchap.DhKey(dhchap.dhgroup_id(g))
                    modexp[g].append(time.perf_counter() - t0)
        finally:
            proc.terminate()
            proc.wait(15)
    ref = statistics.median(times["none"])
    rows = [{"case": k, "connect_ms": statistics.median(v) * 1000,
             "ratio_to_no_auth": statistics.median(v) / ref} for k, v in times.items()]
    pows = {g: statistics.median(v) * 1000 for g, v in modexp.items()}
    if a.json:
        print(json.dumps({"rounds": a.rounds, "io_queues": a.io_queues, "rows": rows,
                          "modexp_ms": pows}, indent=2))
        return
    print(f"connect + close, admin + {a.io_queues} I/O queues, bidirectional, "
          f"median of {a.rounds} rounds")
    for r in rows:
        print(f"  {r['case']:18s} {r['connect_ms']:9.1f} ms   ×{r['ratio_to_no_auth']:7.1f}")
    print("one modular exponentiation (pow): " +
          ", ".join(f"{g} {ms:.1f} ms" for g, ms in pows.items()))


if __name__ == "__main__":
    main()
