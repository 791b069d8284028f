"""Before/after check for speed work on the serving model: the same ``--json`` reports, byte
for byte, from this tree and from another source tree (``--baseline DIR``, e.g. a checkout
of main).

Runs each command below with ``PYTHONPATH`` set to each tree (``python -m kvtool``) and
compares the two outputs exactly (the JSON text, then the parsed documents, to name the
first difference). Nothing is timed.

* the issue-40 command (``bench/serving_speed.py`` part 1): the Mooncake conversation trace,
  one DRAM tier, timed; and the same with ``--exact-steps``;
* the conversation trace with a GPU tier (prefix caching on), a DRAM and an NVMe tier, by
  concurrency; the synthetic Mooncake trace, timed;
* every fixture trace against every cluster fixture (``--cluster``, P/D included), each
  cluster's default load, and three fixture traces as plain replays;
* 4 engines × 2,000 blocks on the first 2,000 conversation requests (part 2's kvtool side).

    python bench/serving_identity.py --baseline DIR [--quick] [--jobs N]
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRACES = ROOT.parent / "shared" / "traces" / "mooncake"
CLUSTER_4X2000 = """name = "dynamo-4x2000"
block_tokens = 512
router = "kv-aware"
[[engine]]
count = 4
gpu = "h100-sxm"
model = "llama-3-8b"
num_gpu_blocks = 2000
max_num_seqs = 256
max_num_batched_tokens = 8192
"""


def commands(tmp: Path, traces: Path, quick: bool) -> dict[str, list[str]]:
    conv = str(traces / "conversation_trace.jsonl")
    synth = str(traces / "synthetic_trace.jsonl")
    one = ["--simulate", "--format", "mooncake", "--block-tokens", "512"]
    out: dict[str, list[str]] = {
        "conversation dram timed": ["replay", conv, *one, "--dram", "5859blk"],
        "conversation dram exact-steps": ["replay", conv, *one, "--dram", "5859blk",
                                          "--exact-steps"],
        "conversation dram no-times": ["replay", conv, *one, "--dram", "5859blk",
                                       "--no-times"],
    }
    if quick:
        return out
    out["conversation gpu+dram+nvme concurrency 64"] = [
        "replay", conv, *one, "--gpu", "3000blk", "--dram", "5859blk", "--nvme",
        "40000blk", "--concurrency", "64"]
    out["synthetic dram timed"] = ["replay", synth, *one, "--dram", "20000blk"]
    first = tmp / "conversation-2000.jsonl"
    with open(conv) as src, open(first, "w") as dst:
        for i, text in enumerate(src):
            if i == 2000:
                break
            dst.write(text)
    cluster = tmp / "dynamo-4x2000.toml"
    cluster.write_text(CLUSTER_4X2000)
    out["4x2000 kv-aware, 2,000 conversation requests"] = [
        "replay", str(first), *one, "--cluster", str(cluster)]
    fixtures = ROOT / "fixtures"
    for trace in ("multiturn-8x12.jsonl", "multiturn-4x6.tokens.jsonl", "bailian-sample.jsonl",
                  "azure-conv-head.csv"):
        path = str(fixtures / "traces" / trace)
        out[f"{trace} plain"] = ["replay", path, "--simulate", "--dram", "64blk"]
        for c in sorted((fixtures / "clusters").glob("*.toml")):
            out[f"{trace} × {c.stem}"] = ["replay", path, "--simulate", "--cluster", str(c)]
    return out


def run(tree: Path, args: list[str]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, "-m", "kvtool", "--json", *args], env=env,
                       capture_output=True, text=True, cwd=tempfile.gettempdir())
    return p.returncode, p.stdout if p.returncode == 0 else p.stdout + p.stderr


def first_difference(a: object, b: object, path: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        assert isinstance(b, dict)
        for k in list(a) + [k for k in b if k not in a]:
            d = first_difference(a.get(k), b.get(k), f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        assert isinstance(b, list)
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True)
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--quick", action="store_true", help="the issue-40 command only")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    base = a.baseline.resolve()
    with tempfile.TemporaryDirectory(prefix="kvtool-identity-") as tmp:
        cmds = commands(Path(tmp), a.traces, a.quick)

        def both(item: tuple[str, list[str]]) -> tuple[str, tuple[int, str], tuple[int, str]]:
            name, args = item
            return name, run(base, args), run(ROOT, args)

        bad = 0
        with ThreadPoolExecutor(a.jobs) as pool:
            for name, (rc0, out0), (rc1, out1) in pool.map(both, cmds.items()):
                if rc0 == rc1 and out0 == out1:
                    print(f"same   {name} ({len(out1):,} bytes, exit {rc1})")
                    continue
                bad += 1
                why = f"exit {rc0} != {rc1}"
                if rc0 == rc1 == 0:
                    why = first_difference(json.loads(out0), json.loads(out1)) or "text only"
                elif rc0 == rc1:
                    why = "".join(list(difflib.unified_diff(out0.splitlines(True),
                                                            out1.splitlines(True)))[:20])
                print(f"DIFFER {name}: {why}")
    print(f"{len(cmds) - bad} of {len(cmds)} the same")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
