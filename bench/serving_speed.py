"""Speed of the serving model's times (issue 40), each figure a ratio to a reference measured
in the same run.

1. **Timed replay against ``--no-times``**: ``kvtool replay TRACE --simulate --format
   mooncake --block-tokens 512 --dram 5859blk`` (the Mooncake conversation trace, one DRAM
   tier; its times come from the serving model's one-engine case) against the same command
   with ``--no-times``. Bar: at most 3×. The same command with ``--exact-steps`` (every
   engine step scheduled on its own) is timed beside it, once per round.
2. **Against NVIDIA Dynamo's offline replay**: 4 engines × 2,000 blocks of 512 tokens, the
   first 2,000 requests of the conversation trace at their timestamps, a KV-aware router.
   kvtool: ``kvtool replay FIRST2000 --simulate --cluster C --json`` with ``C`` 4 engines
   (Llama-3-8B on H100, ``num_gpu_blocks = 2000``, 256 sequences / 8,192 tokens per step,
   the mocker's defaults) and the ``kv-aware`` router; Dynamo 1.6.1:
   ``dynamo.replay.run_trace_replay`` with 4 mocker workers of 2,000 blocks and
   ``router_mode="kv_router"`` (Rust, virtual clock), in the virtualenv
   ``tests/helpers/dynamo_venv.py`` caches under /var/tmp. Whole process against whole
   process. Bar: kvtool faster (ratio below 1). The two model different engines (kvtool's
   roofline, Dynamo's mocker) on the same setup; their hit ratios are printed beside.

Commands are interleaved round by round (load from other processes hits each alike); the
medians of wall and CPU seconds and the median of the per-round CPU ratios are printed.
``--baseline DIR`` also times part 1 from another source tree (an older commit: before
and after in one run). ``--skip-dynamo`` leaves part 2 out.

    python bench/serving_speed.py [--repeat 5] [--baseline DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from replay_speed import Runs, _here, measure, paired, timed  # noqa: E402

from tests.helpers.dynamo_venv import QUIET, dynamo_python, replay_command  # noqa: E402

DEFAULT_TRACE = HERE.parent.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
CLUSTER = """name = "dynamo-4x2000"
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


def kvtool_cli() -> list[str]:
    """The environment's ``kvtool`` script (as a user runs it), else ``python -m kvtool``."""
    script = Path(sys.executable).with_name("kvtool")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtool"]


def line(name: str, r: Runs, ref: Runs | None = None, bar: float | None = None) -> str:
    text = f"  {name:<34} wall {r.wall:6.2f} s  cpu {r.cpu:6.2f} s"
    if ref is not None:
        ratio = paired(r.cpus, ref.cpus)
        text += f"  ratio {ratio:5.2f}"
        if bar is not None:
            text += f" (bar ≤ {bar:g}: {'met' if ratio <= bar else 'MISSED'})"
    return text


def part1(trace: str, repeat: int, baseline: Path | None, out: dict[str, object]) -> None:
    kv = kvtool_cli()
    cmd = [*kv, "replay", trace, "--simulate", "--format", "mooncake", "--block-tokens", "512",
           "--dram", "5859blk"]
    cmds = {"timed": cmd, "no-times": [*cmd, "--no-times"], "exact": [*cmd, "--exact-steps"]}
    envs: dict[str, dict[str, str]] = {}
    if baseline is not None:
        cmds["baseline"] = [sys.executable, "-m", "kvtool", *cmd[len(kv):]]
        envs["baseline"] = {**os.environ, "PYTHONPATH": str(baseline.resolve())}
    m = measure(cmds, repeat, envs)
    ref = m["no-times"]
    print(f"1. {Path(trace).name}, one DRAM tier of 5,859 blocks, {repeat} rounds:")
    print(line("--no-times (reference)", ref))
    print(line("timed (event-driven)", m["timed"], ref, 3.0))
    print(line("timed --exact-steps", m["exact"], ref))
    if baseline is not None:
        print(line(f"timed, baseline {baseline.name}", m["baseline"], ref))
    out["timed_vs_no_times"] = {
        name: {"median_wall_s": r.wall, "median_cpu_s": r.cpu, "least_cpu_s": r.least,
               "cpu_ratio_to_no_times": paired(r.cpus, ref.cpus)} for name, r in m.items()}


def part2(trace: str, repeat: int, out: dict[str, object]) -> None:
    py = dynamo_python()
    if isinstance(py, str):
        print(f"2. skipped: Dynamo 1.6.1 is not available ({py})")
        out["dynamo"] = {"skipped": py}
        return
    with tempfile.TemporaryDirectory(prefix="kvtool-bench-") as tmp:
        first = Path(tmp) / "conversation-2000.jsonl"
        with open(trace) as src, open(first, "w") as dst:
            for i, text in enumerate(src):
                if i == 2000:
                    break
                dst.write(text)
        cluster = Path(tmp) / "dynamo-4x2000.toml"
        cluster.write_text(CLUSTER)
        cmds = {"kvtool": [*kvtool_cli(), "--json", "replay", str(first), "--simulate",
                           "--format", "mooncake", "--block-tokens", "512", "--cluster",
                           str(cluster)],
                "dynamo": replay_command(py, first, workers=4, blocks=2000, block_tokens=512)}
        envs = {"kvtool": _here(), "dynamo": {**_here(), **QUIET}}
        timed(cmds["dynamo"], envs["dynamo"])  # warm: its 226 MB library off the disk
        runs: dict[str, list[tuple[float, float, str]]] = {"kvtool": [], "dynamo": []}
        for _ in range(repeat):
            for name in ("dynamo", "kvtool"):
                runs[name].append(timed(cmds[name], envs[name]))
    kr, dr = runs["kvtool"], runs["dynamo"]
    wall = paired([r[0] for r in kr], [r[0] for r in dr])
    cpu = paired([r[1] for r in kr], [r[1] for r in dr])
    kdoc, ddoc = json.loads(kr[0][2]), json.loads(dr[0][2].strip().splitlines()[-1])
    med = {n: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
           for n, rs in runs.items()}
    print(f"2. 4 engines × 2,000 blocks, first 2,000 conversation requests, {repeat} rounds:")
    for name, label in (("dynamo", "Dynamo 1.6.1 offline replay"),
                        ("kvtool", "kvtool replay --cluster")):
        print(f"  {label:<34} wall {med[name][0]:6.2f} s  cpu {med[name][1]:6.2f} s")
    print(f"  kvtool / Dynamo: wall {wall:4.2f}, cpu {cpu:4.2f} (per-round medians; bar < 1: "
          f"{'met' if wall < 1.0 else 'MISSED'})")
    print(f"  token hit ratio: kvtool {kdoc['runs'][0]['cache']['token_hit_ratio']:.4f}, "
          f"Dynamo {ddoc['prefix_cache_reused_ratio']:.4f} (one run; Dynamo breaks ties "
          f"at random); Dynamo's own replay loop: {ddoc['wall_time_ms'] / 1000:.2f} s")
    out["dynamo"] = {"kvtool": {"median_wall_s": med["kvtool"][0],
                                "median_cpu_s": med["kvtool"][1]},
                     "dynamo": {"median_wall_s": med["dynamo"][0],
                                "median_cpu_s": med["dynamo"][1]},
                     "wall_ratio": wall, "cpu_ratio": cpu,
                     "kvtool_hit_ratio": kdoc["runs"][0]["cache"]["token_hit_ratio"],
                     "dynamo_hit_ratio": ddoc["prefix_cache_reused_ratio"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None)
    ap.add_argument("--skip-dynamo", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    trace = str(Path(a.trace).resolve())
    if not Path(trace).exists():
        sys.exit(f"no trace at {trace} (../shared/traces/mooncake is reference material)")
    out: dict[str, object] = {"trace": trace, "repeat": a.repeat}
    part1(trace, a.repeat, a.baseline, out)
    if not a.skip_dynamo:
        part2(trace, a.repeat, out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
