"""Start-up of short kvtool commands as whole processes, against ``python -c 'import numpy'``.

Targets (issue 9): ``kvtool load`` of one object, ``kvtool verify`` of that object and
``kvtool replay --simulate`` of a one-line trace (plain ``replay`` where a checkout has no
``--simulate``) each take at most 0.25 s as a whole process; issue 24: ``kvtool load`` at
most 2× ``import numpy`` (the CPU ratio's verdict is printed; BENCHMARKS.md gives the wall
ratio beside it). Wall
time depends on the machine, so the run also times the reference ``python -c 'import
numpy'`` (and ``python -c pass``, the interpreter alone) and prints each command's ratio to
it; the ratio is what carries over between machines. Runs are interleaved round-robin so
that load from other processes hits every command alike; the minimum and the median of
``--repeat`` runs are reported (the minimum is the best estimate of the cost itself on a
shared machine).

    python bench/startup.py [--repeat 15] [--dir build/startup] [--json] [--checkout DIR]
        [--baseline DIR]

``--dir`` must be on a real filesystem (O_DIRECT): the store file lives there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TARGET_S = 0.25
CPU_TARGET_RATIO = 2.0
"""Issue 24: ``kvtool load`` of one object at most 2× ``import numpy`` (CPU, min over min)."""
TRACE_LINE = ('{"session":1,"round":1,"input_length":3072,"output_length":256,'
              '"block_tokens":256,"hash_ids":[0,1,2,3,4,5,6,7,8,9,10,11]}\n')


class Kvtool:
    """How to run kvtool: the installed ``kvtool``, or ``python -S -m kvtool`` from a
    source tree (for a before/after comparison: -S keeps the installed editable finder out
    of the way), run in that tree (``python -m`` puts the working directory first on
    sys.path) with ``PYTHONPATH=TREE:site-packages``."""

    def __init__(self, checkout: Path | None) -> None:
        self.cwd: Path | None = None
        self.env: dict[str, str] | None = None
        if checkout is not None:
            site = [p for p in sys.path if p.endswith("site-packages")]
            self.cwd = checkout.resolve()
            self.env = {**os.environ,
                        "PYTHONPATH": os.pathsep.join([str(self.cwd), *site])}
            self.cmd = [sys.executable, "-S", "-m", "kvtool"]
        else:
            exe = Path(sys.executable).with_name("kvtool")
            self.cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvtool"]


def timed(cmd: list[str], before: list[str] | None = None,
          k: Kvtool | None = None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + sys of the child) of one run (of ``k``'s tree)."""
    if before:
        subprocess.run(before, check=True, capture_output=True)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=k.cwd if k else None,
                   env=k.env if k else None)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def simulate(k: Kvtool) -> list[str]:
    """``--simulate`` where replay has it (metadata only: what start-up is about)."""
    out = subprocess.run([*k.cmd, "replay", "--help"], capture_output=True, text=True,
                         cwd=k.cwd, env=k.env).stdout
    return ["--simulate"] if "--simulate" in out else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--dir", type=Path, default=HERE.parent / "build" / "startup")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--checkout", type=Path, help="time kvtool from this source tree instead "
                    "(python -S -m kvtool with PYTHONPATH=CHECKOUT:site-packages)")
    ap.add_argument("--baseline", type=Path, help="also time kvtool from this source tree "
                    "(as --checkout), interleaved in the same runs: a before/after figure")
    args = ap.parse_args()
    d: Path = args.dir
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    store, trace = d / "one.img", d / "one.jsonl"
    trace.write_text(TRACE_LINE)
    fresh = [sys.executable, "-c", f"import os; p = {str(store)!r}; os.path.exists(p) and "
             f"os.remove(p); open(p, 'wb').truncate(4 << 20)"]
    cmds: dict[str, tuple[list[str], list[str] | None, Kvtool | None]] = {
        "python -c pass": ([sys.executable, "-c", "pass"], None, None),
        "python -c 'import numpy'": ([sys.executable, "-c", "import numpy"], None, None),
    }
    trees = [("", Kvtool(args.checkout))]
    if args.baseline is not None:
        trees.append(("baseline: ", Kvtool(args.baseline)))
    for tag, k in trees:
        cmds |= {
            f"{tag}kvtool --version": ([*k.cmd, "--version"], None, k),
            f"{tag}kvtool --help": ([*k.cmd, "--help"], None, k),
            f"{tag}kvtool load (1 object, new store)": (
                [*k.cmd, "load", str(store), "--object-bytes", "4096", "--count", "1"], fresh,
                k),
            f"{tag}kvtool verify (1 object)": ([*k.cmd, "verify", str(store)], None, k),
            f"{tag}kvtool replay (1-line trace)": (
                [*k.cmd, "replay", *simulate(k), str(trace), "--dram", "10blk"], None, k),
        }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cmds}
    for _ in range(args.repeat):
        for name, (cmd, before, tree) in cmds.items():
            runs[name].append(timed(cmd, before, tree))
    ref = min(w for w, _ in runs["python -c 'import numpy'"])
    ref_cpu = min(c for _, c in runs["python -c 'import numpy'"])
    rows: list[dict[str, Any]] = []
    for name, wc in runs.items():
        ts, cpu = [w for w, _ in wc], [c for _, c in wc]
        rows.append({"command": name, "min_s": min(ts), "median_s": statistics.median(ts),
                     "ratio_to_numpy": min(ts) / ref, "cpu_min_s": min(cpu),
                     "cpu_ratio_to_numpy": min(cpu) / ref_cpu if ref_cpu else None,
                     "target_s": TARGET_S if name.startswith(("kvtool load", "kvtool verify",
                                                              "kvtool replay")) else None,
                     "cpu_target_ratio": CPU_TARGET_RATIO if name.startswith("kvtool load")
                     else None})
    shutil.rmtree(d, ignore_errors=True)
    if args.json:
        print(json.dumps({"repeat": args.repeat, "cpus": os.cpu_count(), "rows": rows},
                         indent=2))
        return
    print(f"start-up, whole process, {args.repeat} interleaved runs each (ratio: min over "
          f"the min of python -c 'import numpy' = {ref:.3f} s wall, {ref_cpu:.3f} s CPU)")
    print(f"{'command':46} {'min':>7} {'median':>7} {'ratio':>6} {'cpu min':>8} {'ratio':>6}"
          "  target (wall min; CPU ratio)")
    for r in rows:
        target = "" if r["target_s"] is None else (
            f"≤ {r['target_s']} s: {'met' if r['min_s'] <= r['target_s'] else 'missed'}")
        cpu_ratio = r["cpu_ratio_to_numpy"] or 0.0
        if r["cpu_target_ratio"] is not None:
            target += (f"; ≤ {r['cpu_target_ratio']:.0f}×: "
                       f"{'met' if cpu_ratio <= r['cpu_target_ratio'] else 'missed'}")
        print(f"{r['command']:46} {r['min_s']:7.3f} {r['median_s']:7.3f} "
              f"{r['ratio_to_numpy']:6.2f} {r['cpu_min_s']:8.3f} {cpu_ratio:6.2f}  {target}")


if __name__ == "__main__":
    main()
