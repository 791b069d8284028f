"""Speed of the serving model (issue 19), each figure a ratio to its bar in the same run.

1. The Mooncake conversation trace (12,031 requests over about an hour) replayed at its
   timestamps on ``fixtures/clusters/gp7000.toml`` (4 engines), ``--simulate``: the
   whole process's wall time over the trace's span must be at most 1/100.
2. A 10-point concurrency sweep (1 … 512 users) of a 2,000-request multi-turn trace
   (100 sessions × 20 rounds, made by ``kvtool trace gen``) on the same cluster: under
   60 s of wall time, whole process.

Each command runs ``--repeat`` times; the median is reported. Whole processes through the
CLI, as a user runs them (start-up included).

    python bench/serving.py [--repeat 3] [--trace conversation_trace.jsonl]
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
CLUSTER = REPO / "fixtures" / "clusters" / "gp7000.toml"
KVTOOL = [sys.executable, "-m", "kvtool"]


def timed(cmd: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - start, json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cluster", default=str(CLUSTER))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not Path(a.trace).exists():
        sys.exit(f"no trace at {a.trace} (../shared/traces/mooncake is reference material)")
    results: dict[str, object] = {}

    # 1. the conversation trace at its timestamps
    cmd = [*KVTOOL, "--json", "replay", a.trace, "--simulate", "--format", "mooncake",
           "--block-tokens", "512", "--cluster", a.cluster]
    walls = []
    doc: dict = {}
    for _ in range(a.repeat):
        w, doc = timed(cmd)
        walls.append(w)
    wall = statistics.median(walls)
    reader_span = doc["runs"][0]["serving"]["duration"]
    with open(a.trace) as f:
        stamps = [json.loads(line)["timestamp"] for line in f if line.strip()]
    span = (max(stamps) - min(stamps)) / 1000.0
    results["trace"] = {"requests": len(stamps), "trace_span_s": span,
                        "simulated_duration_s": reader_span, "wall_s": walls,
                        "median_wall_s": wall, "ratio_to_span": wall / span, "bar": 0.01}
    print(f"1. conversation trace on {Path(a.cluster).name}: {len(stamps):,} requests over "
          f"{span:,.0f} s; wall {wall:.1f} s (runs {', '.join(f'{w:.1f}' for w in walls)}) "
          f"= {wall / span:.4f} of the span (bar ≤ 0.01: {'met' if wall / span <= 0.01 else 'MISSED'})")

    # 2. a 10-point sweep of a 2,000-request trace
    with tempfile.TemporaryDirectory() as tmp:
        t2 = str(Path(tmp) / "mt2000.jsonl")
        subprocess.run([*KVTOOL, "trace", "gen", "--sessions", "100", "--rounds", "20",
                        "--input-tokens", "2000", "--output-tokens", "200", "-o", t2],
                       check=True, capture_output=True)
        points = "1,2,4,8,16,32,64,128,256,512"
        cmd = [*KVTOOL, "--json", "replay", t2, "--simulate", "--cluster", a.cluster,
               "--sweep", f"concurrency={points}"]
        walls = []
        for _ in range(a.repeat):
            w, doc = timed(cmd)
            walls.append(w)
    wall = statistics.median(walls)
    tput = [round(r["serving"]["output_throughput"]) for r in doc["runs"]]
    results["sweep"] = {"requests": 2000, "points": points, "wall_s": walls, "median_wall_s": wall,
                        "ratio_to_bar": wall / 60.0, "bar_s": 60.0, "output_throughput": tput}
    print(f"2. sweep concurrency={points} of 2,000 requests: wall {wall:.1f} s (runs "
          f"{', '.join(f'{w:.1f}' for w in walls)}) = {wall / 60:.2f} of the 60 s bar "
          f"({'met' if wall < 60 else 'MISSED'}); output tok/s by point {tput}")
    if a.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
