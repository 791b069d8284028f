"""``kvtool bench --cluster``: every client node drives the storage targets at once.

Like fio's client/server mode: one Ray task per client (engine) node, pinned to that node,
opens its target over NVMe/TCP with the cluster's DH-HMAC-CHAP keys
(:func:`kvtool.store.engine.open_engine`) and runs one case of kvtool's bench
(:func:`kvtool.store.bench.run_case`) for ``seconds``. The tasks connect first, then all
start at one agreed wall-clock instant, so their windows overlap. Client ``i`` drives
target ``i mod len(targets)``.

Figures are measured: a node's GB/s is its bytes over its own window; the aggregate is all
bytes over the union of the windows (first start to last end), so a late node lowers it.
"""

from __future__ import annotations

import time
from typing import Any

from kvtool.cluster.driver import connect, node_resource, run_on_head
from kvtool.cluster.errors import ClusterError
from kvtool.cluster.state import ClusterState
from kvtool.errors import UsageError, param

SCHEMA = "kvtool.cluster.bench/1"
PATTERNS = ("seq-write", "rand-write", "seq-read", "rand-read")  # == kvtool.store.bench's
START_SLACK_S = 10.0
"""Time the tasks get to start and connect before the common start instant."""


def cluster_object_bytes(state: ClusterState) -> int:
    """The object a bench of ``state``'s cluster moves when none is named: one block of its
    engines as one engine's load or store moves it (all ranks), from the cluster file."""
    from kvtool.serving.topology import load_cluster

    return load_cluster(state.file).engines[0].all_ranks_block_bytes


def bench_cluster(state: ClusterState, *, object_bytes: int, patterns: list[str],
                  qds: list[int], seconds: float, clients: int | None = None,
                  region_bytes: int | None = None, force: bool = False) -> dict[str, Any]:
    """Run every (pattern, QD) case on ``clients`` client nodes at once (default: all);
    the ``kvtool.cluster.bench/1`` document."""
    if state.phase != "up":
        raise UsageError(f"cluster {state.name} is not up ({state.phase}): kvtool cluster up "
                         f"{state.file}", field="cluster")
    if not state.targets:
        raise UsageError(f"cluster {state.name} has no storage target ([[nvme.target]])",
                         field="cluster")
    nodes = state.client_nodes()
    if not nodes:
        raise UsageError(f"cluster {state.name} has no engine node to drive the targets from",
                         field="cluster")
    if clients is not None and not 1 <= clients <= len(nodes):
        raise UsageError(f"the cluster has {len(nodes)} client nodes, got {clients}",
                         field="clients")
    bad = [p for p in patterns if p not in PATTERNS]
    if bad or not patterns:
        raise UsageError(f"unknown pattern(s) {', '.join(bad)}", field="pattern")
    if any(p.endswith("write") for p in patterns) and not force:
        raise UsageError(f"write patterns overwrite the cluster's targets (a replay's blocks): "
                         f"use {param('force')}", field="pattern")
    payload = {"object_bytes": object_bytes, "patterns": patterns, "qds": qds,
               "seconds": seconds, "clients": clients or len(nodes),
               "region_bytes": region_bytes}
    cases = len(patterns) * len(qds)
    return run_on_head(state, "bench", payload,
                       timeout=cases * (seconds + START_SLACK_S + 30) + 60)


def run_job(state: ClusterState, payload: dict[str, Any]) -> dict[str, Any]:
    """The driver's side (on the head): the tasks, their rows, the aggregate."""
    ray = connect(state)
    try:
        nodes = state.client_nodes()[:payload["clients"]]
        task = ray.remote(num_cpus=0, max_retries=0)(drive)
        cases = []
        for pattern in payload["patterns"]:
            for qd in payload["qds"]:
                start_at = time.time() + START_SLACK_S
                refs = []
                for i, node in enumerate(nodes):
                    t = state.targets[i % len(state.targets)]
                    refs.append(task.options(resources=node_resource(node.address)).remote(
                        node.name, t.url, t.hostnqn, t.dhchap_key_file,
                        t.dhchap_ctrl_key_file, pattern, qd, payload["object_bytes"],
                        payload["seconds"], payload["region_bytes"], start_at, i))
                try:
                    rows = ray.get(refs)
                except ray.exceptions.RayError as exc:
                    raise ClusterError(f"a bench task failed: {str(exc).splitlines()[-1]}") \
                        from None
                for node, row in zip(nodes, rows, strict=True):
                    row["link_mbit"] = node.link_mbit
                cases.append({"pattern": pattern, "qd": qd, "nodes": rows,
                              "aggregate": aggregate(rows)})
    finally:
        ray.shutdown()
    return {"schema": SCHEMA, "cluster": state.name, "file": state.file,
            "object_bytes": payload["object_bytes"], "seconds": payload["seconds"],
            "clients": len(nodes), "basis": "measured", "cases": cases}


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """All nodes' bytes and ops over the union of their windows."""
    start = min(r["t_start"] for r in rows)
    end = max(r["t_end"] for r in rows)
    window = max(end - start, 1e-9)
    nbytes = sum(r["bytes"] for r in rows)
    ops = sum(r["ops"] for r in rows)
    return {"bytes": nbytes, "ops": ops, "window_s": window, "gb_per_s": nbytes / window / 1e9,
            "iops": ops / window, "late": [r["node"] for r in rows if r["late_s"] > 0]}


def drive(node: str, url: str, hostnqn: str, key_file: str, ctrl_key_file: str | None,
          pattern: str, qd: int, object_bytes: int, seconds: float, region_bytes: int | None,
          start_at: float, seed: int) -> dict[str, Any]:
    """One client node's part (a Ray task on that node): connect, wait, run one case over
    the first ``region_bytes`` of the namespace (``None``: all of it)."""
    from kvtool.nvme.dhchap import load_secret_file
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.store.bench import Case, run_case
    from kvtool.store.engine import open_engine

    creds = HostCredentials(hostnqn, load_secret_file(key_file, field="dhchap_key_file"),
                            load_secret_file(ctrl_key_file, field="dhchap_ctrl_key_file")
                            if ctrl_key_file else None)
    engine = open_engine(url, write=pattern.endswith("write"), qd=qd, credentials=creds)
    try:
        late = time.time() - start_at
        if late < 0:
            time.sleep(-late)
        t_start = time.time()
        region = min(region_bytes or engine.size, engine.size)
        row = run_case(engine, Case(pattern, qd, "aligned", object_bytes),
                       region_bytes=region, seconds=seconds, seed=seed)
        t_end = time.time()
    finally:
        engine.close()
    return {"node": node, "target": url, **row, "bytes": row["ops"] * object_bytes,
            "t_start": t_start, "t_end": t_end, "late_s": max(late, 0.0)}
