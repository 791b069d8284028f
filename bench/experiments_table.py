"""Run every experiment and print the docs/experiments.md table (markdown) from their JSON.

    python bench/experiments_table.py [--simulate | --dram mooncake://HOST:PORT]
        [--out build/experiments] [NAME ...]

Replay experiments run in data mode unless ``--simulate``; the FX100 measurement always
moves real bytes. Each row: claim, published, kvtool, scale note (the experiment's), and
whether kvtool's figure is measured or modelled, with the experiment's own sentence where
the two differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BASIS = {"measured": "measured (timed here)",
         "counted": "measured (counted on real bytes)",
         "simulated": "simulated (exact count, no bytes moved)",
         "modelled": "modelled (serving model / formula)",
         "unavailable": "–"}
HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--out", default=str(REPO / "build" / "experiments"))
    ap.add_argument("--dram", default=None,
                    help="mooncake:// URL: data-mode DRAM tiers on this Mooncake pool "
                         "(replay experiments only)")
    args = ap.parse_args()
    kvtool = [sys.executable, "-m", "kvtool"]
    names = args.names or [e["name"] for e in json.loads(subprocess.run(
        [*kvtool, "--json", "experiment", "list"], check=True, capture_output=True,
        text=True, cwd=REPO).stdout)["experiments"]]
    for name in names:
        cmd = [*kvtool, "--json", "experiment", "run", name, "--out",
               str(Path(args.out) / name)]
        replayed = not name.startswith("fx100")
        if args.simulate and replayed:
            cmd.append("--simulate")
        if args.dram and replayed and not args.simulate:
            cmd += ["--dram", args.dram]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        secs = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"\n### {name}: failed ({proc.stderr.strip()})")
            continue
        doc = json.loads(proc.stdout)
        print(f"\n### `{name}` — {doc['title']}\n")
        print(f"Source: {doc['source']}. Mode: **{doc['mode']}**; ran in {secs:.1f} s "
              f"(`{' '.join(cmd[2:])}`).\n")
        print(f"Scale: {doc['scale']}\n")
        if doc.get("notes"):
            print(f"{doc['notes']}\n")
        print("| claim | published | kvtool | unit | measured / modelled |")
        print("|---|---|---|---|---|")
        for r in doc["rows"]:
            basis = BASIS.get(r["basis"], r["basis"])
            print(f"| {r['claim']} | {r['published_text']} | {r['kvtool_text']} | {r['unit']} "
                  f"| {basis} |")
        notes = [r for r in doc["rows"] if r["differs"]]
        if notes:
            print()
            for r in notes:
                print(f"* *{r['claim']}*: {r['differs']}")


if __name__ == "__main__":
    main()
