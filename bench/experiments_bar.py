"""Issue 38's bar over the published performance results: of every modelled experiment row
that carries a published number (or band), how many are within 2× and within 1.25× of it,
and does every row outside 2× say specifically why (a parameter or a missing mechanism,
:mod:`kvtool.experiments.differs`)?

    python bench/experiments_bar.py [--json FILE] [--docs DIR] [NAME ...]

Runs every experiment (replay kinds simulated; parallel-read, which measures this machine,
skipped) and prints one line per counted row, then the counts. A row's factor is
``max(kvtool / published, published / kvtool)``, 1 inside its band. The tests check the
same bar (tests/experiments/test_serving_experiments.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvtool.experiments import list_experiments, run_experiment  # noqa: E402
from kvtool.experiments.differs import named  # noqa: E402


def counted(doc: dict) -> list[dict]:
    return [r for r in doc["rows"] if r["basis"] == "modelled"
            and (r["published"] is not None or r["factor"] is not None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--docs", type=Path, default=None,
                    help="also write each experiment's document here (NAME.json, with the "
                         "seconds it took)")
    args = ap.parse_args()
    exps = [e for e in list_experiments() if e.kind != "parallel-read"
            and (not args.names or e.name in args.names)]
    rows = []
    for exp in exps:
        t0 = time.perf_counter()
        doc = run_experiment(exp, out_dir=None, simulate=True)
        secs = time.perf_counter() - t0
        if args.docs:
            args.docs.mkdir(parents=True, exist_ok=True)
            (args.docs / f"{exp.name}.json").write_text(json.dumps({**doc, "seconds": secs}))
        for r in counted(doc):
            f = r["factor"]
            rows.append({"experiment": exp.name, "claim": r["claim"], "published": r["published"],
                         "published_text": r["published_text"], "kvtool": r["kvtool"],
                         "factor": f, "differs": r["differs"], "named": named(r["differs"])})
            mark = "" if f is not None and f <= 1.25 else " >1.25×" if f is not None and \
                f <= 2 else " >2×"
            print(f"{exp.name[:26]:26} {r['claim'][:56]:56} "
                  f"{'∞' if f is None else f'{f:.2f}':>6}{mark}")
        print(f"  ({exp.name}: {secs:.1f} s)", flush=True)
    n = len(rows)
    w2 = sum(1 for r in rows if r["factor"] is not None and r["factor"] <= 2)
    w125 = sum(1 for r in rows if r["factor"] is not None and r["factor"] <= 1.25)
    vague = [r for r in rows if (r["factor"] is None or r["factor"] > 2) and not r["named"]]
    print(f"\n{n} modelled rows with a published number: {w2} within 2× "
          f"({100 * w2 / max(1, n):.0f} %), {w125} within 1.25× ({100 * w125 / max(1, n):.0f} %); "
          f"rows outside 2× without a specific reason: {len(vague)}")
    for r in vague:
        print(f"  {r['experiment']}: {r['claim']}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "counted": n, "within_2x": w2,
                                         "within_1_25x": w125}, indent=1) + "\n")


if __name__ == "__main__":
    main()
