"""``kvtool bench --cluster``: does the aggregate grow with the client nodes?

Brings up a netns cluster of 3 client nodes and 3 storage nodes (one NVMe/TCP target
each, so client ``i`` has a target of its own), every link shaped with tbf to 200 Mb/s,
and measures ``kvtool bench --cluster`` (rand-read, 1 MiB objects, QD 8) from the first
client alone and from all 3 at once, alternating, ``--repeat`` times each. Prints the
medians and the ratio (target: 3 clients >= 2.5x 1 client), then does the same without
shaping (where this machine's CPUs, not the links, are the limit). Exits 1 when the shaped
ratio misses the target. Needs root and Ray (no Mooncake).

    sudo python bench/cluster.py [--repeat 3] [--seconds 4] [--mbit 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from kvtool.cluster import lifecycle
from kvtool.cluster.bench import bench_cluster
from kvtool.cluster.state import load_state

FILE = """\
name = "{name}"
[placement]
kind = "netns"
subnet = "{subnet}"
{link}
{nodes}
[[engine]]
name = "c"
node = "c0"
gpu = "a100-sxm"
model = "llama-3-8b"
num_gpu_blocks = 16
{engines}
[nvme]
capacity = "64blk"
{targets}
"""


def cluster_file(directory: Path, name: str, subnet: str, mbit: float | None) -> Path:
    nodes = "".join(f'[[node]]\nname = "c{i}"\n' for i in range(3))
    nodes += "".join(f'[[node]]\nname = "s{i}"\nstorage = true\n' for i in range(3))
    engines = "".join(f'[[engine]]\nname = "c{i}"\nnode = "c{i}"\ngpu = "a100-sxm"\n'
                      f'model = "llama-3-8b"\nnum_gpu_blocks = 16\n' for i in (1, 2))
    targets = "".join(f'[[nvme.target]]\nname = "t{i}"\nnode = "s{i}"\nsize = "256MiB"\n'
                      for i in range(3))
    link = f"link_mbit = {mbit}" if mbit else ""
    path = directory / f"{name}.toml"
    path.write_text(FILE.format(name=name, subnet=subnet, link=link, nodes=nodes,
                                engines=engines, targets=targets))
    return path


def measure(file: Path, repeat: int, seconds: float) -> dict[int, list[float]]:
    state = lifecycle.up(file, step=lambda m: print(f"  up: {m}", file=sys.stderr))
    runs: dict[int, list[float]] = {1: [], 3: []}
    try:
        for _ in range(repeat):
            for clients in (1, 3):
                doc = bench_cluster(state, object_bytes=1 << 20, patterns=["rand-read"],
                                    qds=[8], seconds=seconds, clients=clients)
                case = doc["cases"][0]
                per = ", ".join(f"{n['node']} {n['gb_per_s'] * 8e3:.0f}" for n in case["nodes"])
                gbps = case["aggregate"]["gb_per_s"]
                print(f"  {clients} client(s): {gbps * 8e3:7.1f} Mb/s aggregate "
                      f"({per} Mb/s)", file=sys.stderr)
                runs[clients].append(gbps)
    finally:
        recorded = load_state(state.name)
        if recorded is not None:
            lifecycle.down(recorded)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--mbit", type=float, default=200.0)
    args = ap.parse_args()
    met = True
    with tempfile.TemporaryDirectory() as tmp:
        for label, name, subnet, mbit in (
                (f"shaped {args.mbit:g} Mb/s per link", "bench-shaped", "10.221.0.0/24",
                 args.mbit),
                ("unshaped", "bench-unshaped", "10.222.0.0/24", None)):
            print(f"{label}:", file=sys.stderr)
            runs = measure(cluster_file(Path(tmp), name, subnet, mbit), args.repeat,
                           args.seconds)
            one, three = statistics.median(runs[1]), statistics.median(runs[3])
            ratio = three / one
            verdict = ""
            if mbit:
                ok = ratio >= 2.5
                met = met and ok
                verdict = f"  (target >= 2.5x: {'met' if ok else 'MISSED'})"
            print(f"{label}: 1 client {one * 1e3:.1f} MB/s, 3 clients {three * 1e3:.1f} MB/s "
                  f"(medians of {args.repeat}, measured), ratio {ratio:.2f}x{verdict}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
