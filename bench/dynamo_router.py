"""kvtool's ``kv-aware`` router against NVIDIA Dynamo 1.6.1's own offline replay.

For each configuration (trace, workers, blocks per worker; 512-token blocks, the trace's
timestamps, engines on Dynamo's mocker clock) it prints:

* the token hit ratio of Dynamo's KV router (mean over ``--runs`` replays: Dynamo breaks
  equal costs at random) and of kvtool's (mean over as many tie-break seeds), and the
  relative difference — the issue's bar is ±5 %;
* round-robin on both (one run each: no ties) — bar ±2 %;
* per-request choices: with Dynamo's choices replayed into kvtool's router, the share of
  requests whose Dynamo choice is among kvtool's least-cost engines; and, free-running,
  requests on the same worker (best relabelling) between kvtool and Dynamo, beside the
  same between two Dynamo runs.

Needs Dynamo's wheels (tests/helpers/dynamo_oracle.py makes the cached virtualenv) and
../shared/traces/mooncake. Usage: ``python bench/dynamo_router.py [--runs 3] [--json F]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.dynamo_oracle import (  # noqa: E402
    cluster_text,
    dynamo_python,
    dynamo_replay,
    kvtool_replay,
    same_worker,
)

TRACES = REPO.parent / "shared" / "traces" / "mooncake"
CONFIGS = [
    # (trace, first request, requests, workers, blocks per worker)
    ("conversation_trace.jsonl", 0, 2000, 4, 2000),
    ("conversation_trace.jsonl", 0, 2000, 2, 4000),
    ("conversation_trace.jsonl", 0, 2000, 8, 1000),
    ("conversation_trace.jsonl", 4000, 2000, 4, 1000),
    ("synthetic_trace.jsonl", 0, 2000, 4, 2000),
]


def slice_trace(name: str, start: int, n: int, into: Path) -> Path:
    lines = (TRACES / name).read_text().splitlines()[start: start + n]
    out = into / f"{Path(name).stem}-{start}-{n}.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def compare(trace: Path, workers: int, blocks: int, runs: int, tmp: Path) -> dict[str, object]:
    py = dynamo_python()
    if isinstance(py, str):
        raise SystemExit(f"Dynamo is not available: {py}")
    dyn = dynamo_replay(py, trace, workers=workers, blocks=blocks, block_tokens=512,
                        modes=[("round_robin", 1), ("kv_router", runs)])
    d_rr = dyn[0]
    d_kv = dyn[1:]
    files = {}
    for router, seed in [("round-robin", 0)] + [("kv-aware", s) for s in range(runs)]:
        p = tmp / f"c-{router}-{seed}.toml"
        p.write_text(cluster_text(workers, blocks, 512, router, tie_seed=seed))
        files[(router, seed)] = p
    k_rr = kvtool_replay(files[("round-robin", 0)], trace, block_tokens=512)
    k_kv = [kvtool_replay(files[("kv-aware", s)], trace, block_tokens=512)
            for s in range(runs)]
    replayed = [kvtool_replay(files[("kv-aware", 0)], trace, block_tokens=512,
                              forced=d.workers) for d in d_kv]
    n = len(d_rr.workers)
    d_mean = statistics.fmean(d.ratio for d in d_kv)
    k_mean = statistics.fmean(k.ratio for k in k_kv)
    dd = [same_worker(a.workers, b.workers, workers) for a, b in itertools.pairwise(d_kv)]
    dk = [same_worker(d.workers, k.workers, workers) for d, k in zip(d_kv, k_kv, strict=True)]
    return {
        "trace": trace.name, "requests": n, "workers": workers, "blocks": blocks,
        "runs": runs,
        "dynamo_kv": [d.ratio for d in d_kv], "kvtool_kv": [k.ratio for k in k_kv],
        "dynamo_kv_mean": d_mean, "kvtool_kv_mean": k_mean,
        "kv_diff_pct": 100 * (k_mean / d_mean - 1),
        "dynamo_rr": d_rr.ratio, "kvtool_rr": k_rr.ratio,
        "rr_diff_pct": 100 * (k_rr.ratio / d_rr.ratio - 1),
        "rr_same_worker": sum(1 for a, b in zip(d_rr.workers, k_rr.workers, strict=True)
                              if a == b),
        "replayed_in_argmin": [r.in_argmin for r in replayed],
        "replayed_ratio": [r.ratio for r in replayed],
        "same_worker_dyn_dyn": dd, "same_worker_dyn_kv": dk,
        "dynamo_mean_ttft_ms": statistics.fmean(d.mean_ttft_ms for d in d_kv),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtool-dyn-") as tmp:
        for name, start, n, w, b in CONFIGS:
            trace = slice_trace(name, start, n, Path(tmp))
            r = compare(trace, w, b, args.runs, Path(tmp))
            rows.append(r)
            print(f"{name}[{start}:{start + n}] {w}×{b}: kv-aware Dynamo "
                  f"{r['dynamo_kv_mean']:.4f} kvtool {r['kvtool_kv_mean']:.4f} "
                  f"({r['kv_diff_pct']:+.1f} %); round-robin {r['dynamo_rr']:.4f} / "
                  f"{r['kvtool_rr']:.4f} ({r['rr_diff_pct']:+.1f} %); Dynamo's choices "
                  f"among kvtool's cheapest {r['replayed_in_argmin']} of {n}; same worker "
                  f"dyn-dyn {r['same_worker_dyn_dyn']} dyn-kvtool {r['same_worker_dyn_kv']}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
