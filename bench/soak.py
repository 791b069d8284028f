"""Soak: the 50-round experiment in data mode over NVMe/TCP, for a long time (issue 11).

    python bench/soak.py --duration 3600 [--out build/soak]

One long-lived kvtool NVMe/TCP target (``python -m emulator.nvmetcp``, memory-backed,
127.0.0.1, with ``--metrics-port``) serves the NVMe tier; the script replays the
``gp7000-50-rounds`` workload (its DRAM/8 + NVMe configuration, a CPU "GPU" tier in front)
in data mode again and again, a new seed each pass, until ``--duration`` has passed.
Every block arriving in the GPU tier is checked by the engine; a corrupt or lost block
is counted and recomputed, never served.

Recorded per pass and in total: requests, bytes moved per link (measured by the
replay), corrupt and lost blocks, exit status; the target's resident memory (VmRSS)
after every pass, and the replays' peak RSS, for memory growth; the target's own
Prometheus counters (commands, bytes, error completions) at the end. Then
``kvtool verify`` of the namespace: each replay commits its NVMe tier's store index at
its end, so verify checks, byte for byte (CRC32C and the payload regenerated from the
key), every block the last pass left on the medium; their count must equal the blocks
that pass committed. Errors (corrupt or lost blocks, failed passes, verify finding a bad
object or a different count) must be 0. Writes ``soak.json`` and prints
the BENCHMARKS.md paragraph. Not a CI test (it runs for as long as it is told).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

from emulator.nvmetcp.spawn import spawned

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NQN = "nqn.2026-01.io.kvtool:soak"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def scrape(port: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if (line.startswith("kvtool_nvmetcp_") and " " in line
                    and "_created" not in line):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds (default 3600)")
    ap.add_argument("--experiment", default="gp7000-50-rounds")
    ap.add_argument("--config", default="DRAM/8 + NVMe", help="the experiment's configuration")
    ap.add_argument("--gpu", default="64blk", help="CPU 'GPU' tier in front (default 64blk)")
    ap.add_argument("--block-bytes", type=int, default=65536,
                    help="bytes per block in data mode (default 64 KiB: many passes per hour)")
    ap.add_argument("--backing", default="512MiB", help="target namespace size (memory)")
    ap.add_argument("--out", default=str(REPO / "build" / "soak"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exp = tomllib.loads((REPO / "fixtures" / "experiments" / f"{args.experiment}.toml").read_text())
    w = exp["workload"]
    tiers = next(c["tiers"] for c in exp["config"] if c["label"] == args.config)
    caps = dict(p.split("=", 1) for p in tiers.split(",") if p.split("=", 1)[0] in ("dram", "nvme"))
    kvtool = [sys.executable, "-m", "kvtool"]
    metrics_port = free_port()
    target_args = ["--listen", "127.0.0.1:0", "--nqn", NQN, "--backing", args.backing,
                   "--allow-any-host", "--metrics-port", str(metrics_port)]
    with spawned(target_args, workdir=out) as target:
        url, proc = target.url(), target.proc
        passes: list[dict[str, Any]] = []
        t_start = time.monotonic()
        target_rss = [rss_kib(proc.pid)]
        seed = 0
        while time.monotonic() - t_start < args.duration:
            seed += 1
            trace = out / "trace.jsonl"
            subprocess.run([*kvtool, "-q", "trace", "gen", "--sessions", str(w["sessions"]),
                            "--rounds", str(w["rounds"]), "--input-tokens", str(w["input_tokens"]),
                            "--output-tokens", str(w["output_tokens"]), "--system-prompt-tokens",
                            str(w.get("system_prompt_tokens", 0)), "--block-tokens",
                            str(w.get("block_tokens", 256)), "--seed", str(seed), "--format",
                            "hash_ids", "-o", str(trace)], check=True, cwd=REPO,
                           capture_output=True)
            t0 = time.monotonic()
            r = subprocess.run([*kvtool, "--json", "replay", str(trace), "--block-bytes",
                                str(args.block_bytes), "--gpu", args.gpu, "--dram", caps["dram"],
                                "--nvme", url], capture_output=True, text=True, cwd=REPO)
            secs = time.monotonic() - t0
            row: dict[str, Any] = {"pass": seed, "exit": r.returncode, "seconds": secs}
            if r.returncode == 0:
                doc = json.loads(r.stdout)
                row.update(requests=doc["requests"], corrupt=doc.get("corrupt_blocks", 0),
                           lost=doc.get("lost_blocks", 0), measured=doc.get("measured", {}),
                           hit_ratio=doc["token_hit_ratio"],
                           committed=next((t["committed_objects"] for t in doc["tiers"]
                                           if t["name"] == "nvme"), None))
            else:
                row["error"] = r.stderr.strip()[-500:]
            row["target_rss_kib"] = rss_kib(proc.pid)
            row["replay_maxrss_kib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            target_rss.append(row["target_rss_kib"])
            passes.append(row)
            print(f"soak: pass {seed}: exit {row['exit']} · {row.get('requests', 0)} requests · "
                  f"{secs:.1f} s · corrupt {row.get('corrupt')} lost {row.get('lost')} · "
                  f"target RSS {row['target_rss_kib'] / 1024:.1f} MiB", flush=True)
        counters = scrape(metrics_port)
        v = subprocess.run([*kvtool, "--json", "verify", url], capture_output=True, text=True,
                           cwd=REPO)
    wall = time.monotonic() - t_start
    link_bytes = sum(sum(link.get("bytes", 0) for link in p.get("measured", {}).get("links", {}).values())
                     if isinstance(p.get("measured", {}).get("links"), dict) else 0 for p in passes)
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} · {os.cpu_count()} CPUs · {platform.platform()}",
        "command": " ".join(sys.argv), "duration_asked_s": args.duration, "wall_s": wall,
        "passes": len(passes), "failed_passes": sum(p["exit"] != 0 for p in passes),
        "requests": sum(p.get("requests", 0) for p in passes),
        "corrupt_blocks": sum(p.get("corrupt", 0) or 0 for p in passes),
        "lost_blocks": sum(p.get("lost", 0) or 0 for p in passes),
        "link_bytes": link_bytes,
        # The memory-backed namespace is touched during the first pass; growth is judged
        # from there on.
        "target_rss_kib": {"start": target_rss[0],
                           "after_first_pass": target_rss[1] if len(target_rss) > 1 else None,
                           "end": target_rss[-1], "max": max(target_rss)},
        "replay_maxrss_kib": max((p["replay_maxrss_kib"] for p in passes), default=0),
        "target_counters": counters, "verify_exit": v.returncode,
        "verify": (json.loads(v.stdout) if v.returncode in (0, 1) and v.stdout.strip()
                   else v.stderr.strip()),
        "passes_detail": passes,
    }
    vdoc = summary["verify"] if isinstance(summary["verify"], dict) else {}
    committed = passes[-1].get("committed") if passes else None
    summary["verify_objects"] = {
        "committed_by_last_pass": committed, "indexed": vdoc.get("objects_indexed"),
        "checked": vdoc.get("objects_checked"), "content_checked": vdoc.get("content_checked"),
        "bytes_checked": vdoc.get("bytes_checked"), "bad": len(vdoc.get("bad", [])),
        "seconds": vdoc.get("seconds")}
    verify_ok = v.returncode == 0 and committed is not None \
        and vdoc.get("objects_checked") == vdoc.get("content_checked") == committed
    summary["verify_ok"] = verify_ok
    (out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    errors = (summary["corrupt_blocks"] + summary["lost_blocks"] + summary["failed_passes"]
              + (0 if verify_ok else 1))
    print(f"\nsoak: {len(passes)} passes in {wall:.0f} s, {summary['requests']:,} requests, "
          f"{link_bytes / 1e9:.2f} GB over the replay's links, errors {errors}, target RSS "
          f"after pass 1 {target_rss[min(1, len(target_rss) - 1)] / 1024:.1f} → "
          f"{target_rss[-1] / 1024:.1f} MiB; verify exit {v.returncode}: "
          f"{vdoc.get('objects_checked')} objects checked ({vdoc.get('content_checked')} "
          f"with content, {len(vdoc.get('bad', []))} bad) of the {committed} the last pass "
          f"committed; details in {out / 'soak.json'}")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
