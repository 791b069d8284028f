"""``kvtool replay``: a request trace through a tiered prefix cache (thin shell over
:mod:`kvtool.cache`). JSON schema and semantics: docs/replay.md."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from kvtool.cache.names import POLICY_NAMES, WRITE_POLICIES
from kvtool.cli.hostopts import host_options
from kvtool.cli.options import block_size_options
from kvtool.cli.output import emit, json_option, note, progress, settings, want_json
from kvtool.errors import CheckFailed, UsageError, param
from kvtool.gcpause import cyclic_gc_paused
from kvtool.trace.schema import FORMATS
from kvtool.units import format_size

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials
    from kvtool.replay.settings import ReplaySettings


EPILOG = """
\b
Examples:
  kvtool replay trace.jsonl        # data mode, default tiers (after: kvtool target up)
  kvtool replay trace.jsonl --gpu 64MiB --dram 256MiB --nvme 512MiB@/var/tmp/kv-cache.img
  kvtool replay trace.jsonl --dram 512MiB --read-qd 32 \\
      --nvme nvme+tcp://127.0.0.1:4420/nqn.2026-01.io.kvtool:default/1
  kvtool replay conversation_trace.jsonl --format mooncake --block-tokens 512 \\
      --simulate --gpu 1000000tok --dram 3000000tok --nvme inf --json
  kvtool replay mt.jsonl --simulate --model deepseek-v4-flash --dtype fp8 \\
      --compare 'dram=429.5GB' --compare 'dram=53.7GB,nvme=46.09TB' --plot cmp.png
  kvtool replay mt.jsonl --simulate --tiers tiers.toml --csv rounds.csv
  kvtool replay mt.jsonl --simulate --cluster fixtures/clusters/a100-llama2.toml \
      --sweep concurrency=1,4,16 --csv sweep.csv      # the serving model (docs/serving.md)
  kvtool replay mt.jsonl --engine vllm --check-outputs   # a real vLLM (kvtool[vllm])

\b
Data mode (default) moves real bytes: a CPU "GPU" pool, a DRAM pool and an NVMe tier on
kvtool's object store; every block loaded is checked. --simulate counts metadata only
(what-ifs no machine holds). A tier option is a size, a place or SIZE@PLACE.
--compare SPEC (repeatable) adds a configuration: comma-separated key=value with
gpu, dram, nvme (as the tier options), policy, gpu-policy, dram-policy, nvme-policy,
write-policy, watermark, evict-ratio, label.
"""


def _tier(_ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    from kvtool.tiers.option import TierOption

    return TierOption.parse(value, tier=str(param.name))


def _read_gbps(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
               ) -> dict[str, float]:
    out: dict[str, float] = {}
    for v in values:
        tier, eq, rate = v.partition("=")
        try:
            gbps = float(rate)
        except ValueError:
            gbps = -1.0
        if not eq or tier not in ("gpu", "dram", "nvme") or not gbps > 0:
            raise UsageError(f"{v!r}: expected TIER=GB/s with TIER gpu, dram or nvme "
                             "(example: nvme=5.2)", field="--read-gbps")
        out[tier] = gbps
    return out


def _fraction(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not 0 < value <= 1:
        raise UsageError(f"must be a fraction in (0, 1], got {value}", field=param.opts[0])
    return value


@click.command("replay", epilog=EPILOG)
@click.argument("trace", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--simulate", is_flag=True,
              help="Count metadata only (no bytes move): for capacities no machine holds.")
@click.option("--gpu", callback=_tier, metavar="SIZE",
              help="CPU \"GPU\" tier size (0/absent: none) [data-mode default 128MiB].")
@click.option("--dram", callback=_tier, metavar="SIZE",
              help="DRAM tier: bytes (1GiB), blocks (5859blk), tokens (3000000tok); inf with "
                   "--simulate [data-mode default 256MiB].")
@click.option("--nvme", callback=_tier, metavar="[SIZE@]PLACE",
              help="NVMe tier: a size, a place (file, block device, nvme+tcp:// URL) or "
                   "SIZE@PLACE [data-mode default: the running kvtool target].")
@click.option("--policy", type=click.Choice(POLICY_NAMES), default=None, metavar="NAME",
              help="Eviction policy of every tier: " + ", ".join(POLICY_NAMES) + " (vllm: the "
                   "GPU tier only; docs/replay.md) [default: vllm for a finite GPU tier, whose "
                   "size is then vLLM's num_gpu_blocks; lru elsewhere].")
@click.option("--tiers", "tiers_file", type=click.Path(dir_okay=False), default=None,
              help="TOML file: per-tier capacity/policy/watermark and [time] (docs/replay.md).")
@click.option("--write-policy", type=click.Choice(WRITE_POLICIES), default=None,
              help="write-through: computed blocks go to every tier; write-back: down on "
                   "eviction [default: write-through].")
@click.option("--watermark", type=float, default=None, callback=_fraction,
              help="Mooncake batch eviction on every tier: start above this fill (e.g. 0.9).")
@click.option("--evict-ratio", type=float, default=None, callback=_fraction,
              help="Mooncake batch eviction: fraction evicted per batch (default 0.05).")
@click.option("--block-tokens", type=int, default=None,
              help="Tokens per block [default: the trace's; 256 kvtool and Azure, 512 "
                   "Mooncake, 16 Qwen-Bailian].")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)),
              default="auto", show_default=True, help="Trace format (docs/trace.md).")
@block_size_options
@click.option("--compare", "compares", multiple=True, metavar="SPEC",
              help="Add a configuration to replay side by side (repeatable; see below).")
@click.option("--read-qd", type=int, default=32, show_default=True,
              help="Data mode: NVMe-tier reads in flight per request.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Data mode: seed of the block payloads (content = f(chain hash, seed)).")
@click.option("--on-tier-error", type=click.Choice(["fail", "recompute"]), default="fail",
              show_default=True,
              help="Data mode, a tier's medium fails: stop (exit 1), or go on with the tier "
                   "treated as empty.")
@click.option("--skip-bad", type=int, default=0, show_default=True,
              help="Tolerate up to N bad trace lines (reported).")
@click.option("--engine-gpu", default=None, metavar="GPU",
              help="Times: the GPU of the one engine that serves the trace in the serving "
                   "model [default h100-sxm; docs/replay.md].")
@click.option("--no-times", is_flag=True,
              help="Skip the times (hits and bytes only; for large what-if runs).")
@click.option("--exact-steps", is_flag=True,
              help="Times: the serving model schedules every engine step on its own instead "
                   "of jumping between events (slower; the same report).")
@click.option("--read-gbps", multiple=True, callback=_read_gbps, metavar="TIER=GBPS",
              help="Times: GB/s of a tier's path [defaults: dram the GPU's PCIe, nvme 5.2].")
@click.option("--concurrency", type=int, default=None,
              help="Requests in flight (closed loop; with --cluster: users) [default 1].")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write per-round rows to this CSV file.")
@click.option("--requests-csv", "requests_csv", type=click.Path(dir_okay=False), default=None,
              help="Write one row per request (and configuration) to this CSV file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: hit ratio and bytes written per round (needs the plot extra).")
@click.option("--iolog", type=click.Path(dir_okay=False), default=None,
              help="--simulate: write the NVMe tier's reads and writes as a fio iolog "
                   "(fio --read_iolog=FILE).")
@click.option("--iolog-version", type=click.Choice(["2", "3"]), default="3", show_default=True,
              help="fio iolog format (3 carries times in ms).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT while replaying.")
@click.option("--cluster", "clusters", multiple=True, type=click.Path(dir_okay=False),
              metavar="FILE",
              help="Serving model: engines, links, tiers and router from this cluster TOML "
                   "(repeatable: configurations side by side; docs/serving.md).")
@click.option("--request-rate", type=float, default=None,
              help="--cluster: open-loop Poisson arrivals, requests/s (inf: all at once).")
@click.option("--speedup", type=float, default=None,
              help="--cluster: replay the trace's timestamps this many times faster.")
@click.option("--sweep", default=None, metavar="LOAD=V1,V2,...",
              help="--cluster: one run per value, e.g. concurrency=1,4,16,64,256 or "
                   "request-rate=1,2,4.")
@click.option("--scalar", "scalars", multiple=True, metavar="NAME=VALUE",
              help="--cluster: set a roofline scalar, e.g. mfu_prefill=0.5 (repeatable; "
                   "kvtool calibrate fits them).")
@click.option("--jobs", type=int, default=None, metavar="N",
              help="--simulate with --sweep or --compare: run at most N points at once on "
                   "local cores (1: one after the other) [default: the CPUs].")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="--simulate with --sweep or --compare: run the points as tasks on this "
                   "Ray cluster (HOST:PORT, auto, or local) [default: $RAY_ADDRESS, else "
                   "local cores].")
@click.option("--fault", "faults", multiple=True, metavar="KIND@SECONDS[:WHO]",
              help="--cluster on a cluster that is up (data mode): at this simulated second "
                   "kill an engine actor (engine), a storage target (target) or a node "
                   "(node), or cut a node's links (link); WHO names it (repeatable).")
@click.option("--engine", type=click.Choice(["vllm"]), default=None,
              help="Run the trace through a real engine (vLLM, kvtool[vllm]) whose KV "
                   "connector is kvtool's tiers; times are measured (docs/integrations.md).")
@click.option("--model-path", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="--engine: the model checkpoint [default: a tiny random-weight Llama "
                   "kvtool makes once: not a real model].")
@click.option("--check-outputs", is_flag=True,
              help="--engine: run the trace again without the connector and require "
                   "identical greedy tokens.")
@click.option("--bench-result", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="--engine: also write the run as vllm bench serve --save-result JSON "
                   "(for kvtool calibrate).")
@json_option
@host_options
def command(trace: str, simulate: bool, gpu: Any, dram: Any, nvme: Any, policy: str | None,
            tiers_file: str | None, write_policy: str | None, watermark: float | None,
            evict_ratio: float | None, block_tokens: int | None, fmt: str, model: str | None,
            dtype: str | None, tp: int | None, block_bytes: int | None,
            compares: tuple[str, ...], read_qd: int, seed: int, on_tier_error: str,
            skip_bad: int, engine_gpu: str | None, no_times: bool, exact_steps: bool,
            read_gbps: dict[str, float], concurrency: int | None, csv_path: str | None,
            requests_csv: str | None, plot_path: str | None, iolog: str | None,
            iolog_version: str, metrics_port: int | None,
            clusters: tuple[str, ...], request_rate: float | None, speedup: float | None,
            sweep: str | None, scalars: tuple[str, ...], jobs: int | None,
            ray_address: str | None, faults: tuple[str, ...], engine: str | None,
            model_path: str | None, check_outputs: bool, bench_result: str | None,
            credentials: HostCredentials | None) -> None:
    """Replay a request trace through a GPU → DRAM → NVMe prefix cache.

    Data mode (default) moves real bytes through the tiers and checks every block;
    --simulate counts metadata only. Reports the token hit ratio by tier, recomputed
    tokens, puts and promotions per tier, bytes per link (measured in data mode),
    corrupt/lost blocks, the collapse round and TTFT, per round and in total
    (definitions: docs/definitions.md; schema: docs/json.md).
    """
    from kvtool.cache.report import check_output_paths
    from kvtool.replay.run import ReplaySettings

    check_output_paths(csv=csv_path, plot=plot_path, requests_csv=requests_csv, iolog=iolog)
    if engine is not None:
        _engine(locals())
        return
    for name, given in (("model_path", model_path), ("check_outputs", check_outputs or None),
                        ("bench_result", bench_result)):
        if given is not None:
            raise UsageError(f"{param(name)} applies to a real engine: give "
                             f"{param('engine')} vllm", field=name)
    if clusters:
        _check_cluster_options(locals())
        if not ray_address:
            _relaunch_on_head(clusters[0])
    fanout = _fanout(simulate, jobs, ray_address,
                     len(clusters) * len(sweep.split(",")) if sweep and clusters else
                     len(clusters) if clusters else 1 + len(compares), clusters)
    if clusters:
        from kvtool.cli import serving
        from kvtool.serving.calibrate import parse_scalar_overrides

        serving.run(trace=trace, clusters=clusters, simulate=simulate, fmt=fmt,
                    block_tokens=block_tokens, skip_bad=skip_bad, seed=seed,
                    loads=serving.loads_from(concurrency, request_rate, speedup, sweep),
                    csv_path=csv_path, plot_path=plot_path,
                    nvme_place=nvme.place if nvme is not None else None, read_qd=read_qd,
                    credentials=credentials, scalars=parse_scalar_overrides(scalars),
                    fanout=fanout, faults=faults, exact_steps=exact_steps)
        return
    _check_cache_replay_options(faults=faults, exact_steps=exact_steps, no_times=no_times,
                                request_rate=request_rate, speedup=speedup, sweep=sweep,
                                scalars=scalars)
    replay_settings = ReplaySettings(
        trace=trace, fmt=fmt, block_tokens=block_tokens, skip_bad=skip_bad, simulate=simulate,
        tiers={k: v for k, v in (("gpu", gpu), ("dram", dram), ("nvme", nvme)) if v is not None},
        policy=policy, tiers_file=tiers_file, write_policy=write_policy, watermark=watermark,
        evict_ratio=evict_ratio, compares=compares, model=model, dtype=dtype, tp=tp,
        block_bytes=block_bytes, engine_gpu=engine_gpu, times="none" if no_times else "serving",
        exact_steps=exact_steps,
        read_gbps=read_gbps, concurrency=concurrency, read_qd=read_qd, seed=seed,
        on_tier_error=on_tier_error, requests_csv=requests_csv, credentials=credentials,
        iolog=iolog, iolog_version=int(iolog_version))
    doc = _run_cache_replay(replay_settings, fanout, metrics_port)
    _report_cache_replay(doc, trace, csv_path, plot_path)


CLUSTER_FILE_SETS = ("gpu", "dram", "tiers_file", "compares", "policy", "write_policy",
                     "watermark", "evict_ratio", "model", "dtype", "tp", "block_bytes",
                     "engine_gpu", "read_gbps")
"""Options the cluster file decides with ``--cluster`` (its tiers, their policies, the
engines' model and GPUs, the links' rates)."""
CLUSTER_REPORT_HAS_NO = ("no_times", "on_tier_error", "requests_csv", "iolog", "iolog_version",
                         "metrics_port")
"""Options of a replay without ``--cluster`` that the serving model's run does not take."""


def _check_cluster_options(o: dict[str, Any]) -> None:
    """Refuse, in one line, an option a ``--cluster`` replay would otherwise ignore."""
    ctx = click.get_current_context()
    given = [name for name in (*CLUSTER_FILE_SETS, *CLUSTER_REPORT_HAS_NO)
             if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)]
    nvme = o["nvme"]
    if nvme is not None and nvme.capacity is not None:
        raise UsageError(f"with {param('cluster')} the NVMe pool's size is the cluster "
                         f"file's; {param('nvme')} PLACE only says where data mode puts it",
                         field="nvme")
    if not given:
        return
    name = given[0]
    flag = {"tiers_file": "tiers", "compares": "compare"}.get(name, name)
    if name in CLUSTER_FILE_SETS:
        raise UsageError(f"with {param('cluster')} the cluster file sets what "
                         f"{param(flag)} would (tiers, policies, model, GPUs, links)",
                         field=flag)
    why = " (the serving model's run always times its requests)" if name == "no_times" else ""
    raise UsageError(f"{param(flag)} applies to a replay without {param('cluster')}{why}",
                     field=flag)


def _check_cache_replay_options(*, faults: tuple[str, ...], exact_steps: bool, no_times: bool,
                                request_rate: float | None, speedup: float | None,
                                sweep: str | None, scalars: tuple[str, ...]) -> None:
    """Refuse the options a replay without ``--cluster`` does not take."""
    if faults:
        raise UsageError(f"{param('fault')} applies to {param('cluster')} on a cluster that is "
                         "up", field="fault")
    if exact_steps and no_times:
        raise UsageError(f"{param('exact_steps')} says how the times are computed; "
                         f"{param('no_times')} skips them", field="exact_steps")
    for name, value in (("request_rate", request_rate), ("speedup", speedup), ("sweep", sweep),
                        ("scalar", scalars or None)):
        if value is not None:
            raise UsageError(f"{param(name)} sets the serving model's load: give "
                             f"{param('cluster')} too", field=name)


def _run_cache_replay(replay_settings: ReplaySettings, fanout: Any,
                      metrics_port: int | None) -> dict[str, Any]:
    """Prepare and run a replay without ``--cluster``, with its notes, metrics server and
    progress bar; its report document."""
    from kvtool.replay.run import describe_setup, prepare

    simulate = replay_settings.simulate
    requests_csv, iolog = replay_settings.requests_csv, replay_settings.iolog
    if not simulate and not settings().debug:
        # A lost target is reported once, as one line naming the tier and its URL; the
        # host's reconnect attempts would repeat it (--debug shows them). (--simulate
        # reaches no target: it need not import logging.)
        import logging

        logging.getLogger("kvtool.nvme").setLevel(logging.ERROR)
    # A --simulate replay without fanned-out points or a metrics server makes no reference
    # cycles (tests/cli/test_replay_gc.py; the serving model's run, whose engines and tiers
    # refer to one another, breaks its cycles when its times are read), so the cyclic
    # collector's passes over the trace's kept block ids and the times would find nothing:
    # it is paused from reading the trace until the job, which holds them, is gone
    # (kvtool.gcpause).
    acyclic = (simulate and metrics_port is None
               and (fanout is None or fanout.kind == "serial"))
    with cyclic_gc_paused() if acyclic else contextlib.nullcontext():
        job = prepare(replay_settings, on_event=lambda m: note(f"[yellow]{m}[/]"))
        if simulate and not (requests_csv or iolog or metrics_port is not None):
            from kvtool.cli.serving import note_fanout

            note_fanout(fanout, len(job.configs))
        if not simulate:
            for line in describe_setup(job.setup):
                note(line)
        sink = None
        if metrics_port is not None:
            from kvtool.metrics import serve_metrics

            metrics = serve_metrics(metrics_port)
            metrics.block_bytes, metrics.block_tokens = job.block_bytes, job.block_tokens
            note(f"metrics on http://127.0.0.1:{metrics.port}/metrics")
            labels = [c.label for c in job.configs]

            def sink(i: int, outcome: Any) -> None:
                metrics.request(labels[i], outcome)
        # (Ray's notices, when the points fan out over Ray, go to stderr: stdout is the report's)
        with progress("replay", job.total, unit="requests") as advance, \
                contextlib.redirect_stdout(sys.stderr):
            doc = job.run(progress=advance, on_request=sink, fanout=fanout)
        del job  # frees the kept ids by reference counting, before the collector resumes
    return doc


def _report_cache_replay(doc: dict[str, Any], trace: str, csv_path: str | None,
                         plot_path: str | None) -> None:
    """Write, show and check a replay's report: the CSV and plot, the report itself, the
    exit status of an interrupted run or of corrupt or lost blocks."""
    results = doc.get("configs") or [doc]
    if csv_path:
        from kvtool.cache.report import write_csv

        write_csv(results, csv_path)
    if plot_path:
        from kvtool.cache.report import write_plot

        write_plot(results, plot_path, title=f"kvtool replay {Path(trace).name}")
    if doc["bad_lines"] and not want_json():
        for b in doc["bad_lines"]:
            note(f"[yellow]skipped bad line {b['line']}: {b['message']}[/]")
    emit(doc, lambda con: _render(con, results, doc))
    if doc.get("iolog") and not want_json():
        lg = doc["iolog"]
        note(f"fio iolog v{lg['version']}: {lg['path']} ({lg['reads']:,} reads, {lg['writes']:,} "
             f"writes of {lg['block_bytes']:,} B; replay on ≥ {lg['device_bytes']:,} B: "
             f"fio --name=kv --read_iolog={lg['path']} --replay_redirect=DEVICE)")
    if doc["interrupted"]:
        note("interrupted: the report covers the requests served before Ctrl-C")
        raise SystemExit(130)
    # Corrupt blocks, or objects lost from a tier that kept working, are a failed check;
    # a tier that failed under --on-tier-error recompute was asked for and said so.
    if any(r.get("corrupt_blocks") or (r.get("lost_blocks") and
                                       not any(t.get("failed") for t in r["tiers"]))
           for r in results):
        raise CheckFailed("corrupt or lost blocks were found (recomputed, never served); "
                          "see the report")


ENGINE_ONLY_WITHOUT = ("simulate", "compares", "clusters", "sweep", "scalars", "faults",
                       "jobs", "ray_address", "iolog", "requests_csv", "plot_path",
                       "watermark", "evict_ratio", "speedup", "metrics_port", "engine_gpu",
                       "no_times")
"""Options a ``--engine`` replay does not take (they shape a model or a simulation)."""


def _engine(o: dict[str, Any]) -> None:
    """``--engine vllm``: the trace through a real engine on kvtool's tiers."""
    from kvtool.cli import engine as cli_engine
    from kvtool.integrations.engine_replay import EngineReplaySettings
    from kvtool.serving.load import Load

    for name in ENGINE_ONLY_WITHOUT:
        value = o[name]
        if value not in (None, False, (), {}):
            flag = {"compares": "compare", "clusters": "cluster", "scalars": "scalar",
                    "faults": "fault", "ray_address": "ray", "plot_path": "plot",
                    "requests_csv": "requests_csv"}.get(name, name)
            raise UsageError(f"{param(flag)} does not apply to a real engine "
                             f"({param('engine')}): its times are measured, its tiers real",
                             field=flag)
    for name in ("model", "dtype", "tp", "block_bytes", "read_gbps"):
        if o[name] not in (None, {}):
            raise UsageError(f"{param(name)}: with {param('engine')} the block size is the "
                             "model's own (--model-path)", field=name)
    load = None
    if o["concurrency"] is not None:
        load = Load("concurrency", float(o["concurrency"]))
    elif o["request_rate"] is not None:
        load = Load("request-rate", o["request_rate"])
    gpu = o["gpu"]
    if gpu is not None and gpu.place is not None:
        raise UsageError("the GPU tier is the engine's own KV cache: give a size",
                         field="gpu")
    creds = o["credentials"]
    settings = EngineReplaySettings(
        trace=o["trace"], fmt=o["fmt"], block_tokens=o["block_tokens"],
        skip_bad=o["skip_bad"], engine=o["engine"], model_path=o["model_path"],
        gpu=gpu.capacity if gpu is not None else None, dram=o["dram"], nvme=o["nvme"],
        policy=o["policy"], write_policy=o["write_policy"], tiers_file=o["tiers_file"],
        hostnqn=creds.hostnqn if creds is not None else None,
        dhchap_secret=_secret_path("dhchap_secret"),
        dhchap_ctrl_secret=_secret_path("dhchap_ctrl_secret"),
        read_qd=o["read_qd"], load=load, check_outputs=o["check_outputs"], seed=o["seed"],
        bench_result=o["bench_result"])
    if o["policy"] == "vllm":
        raise UsageError("policy 'vllm' is the engine's own KV cache: give the DRAM and NVMe "
                         "tiers' policy", field="policy")
    cli_engine.run(settings, o["csv_path"])


def _secret_path(name: str) -> str | None:
    """A DH-HMAC-CHAP key file given on the command line: the engine's connector reads it
    itself, in the engine's process (the options' values before ``host_options`` loaded
    them)."""
    value = click.get_current_context().params.get(name)
    return str(value) if value else None


def _relaunch_on_head(cluster: str) -> None:
    """A cluster ``kvtool cluster up`` made of namespaces runs this command on its head
    node (:func:`kvtool.replay.head.relaunch_on_head`): the same arguments, output passed
    through, its exit status."""
    from kvtool.replay.head import relaunch_on_head

    rc = relaunch_on_head(cluster, sys.argv[1:], lambda state: note(
        f"running on the head of cluster {state.name} ({state.head.name}, "
        f"{state.head.address})"))
    if rc is not None:
        raise SystemExit(rc)


def _fanout(simulate: bool, jobs: int | None, ray_address: str | None, points: int,
            clusters: tuple[str, ...]) -> Any:
    """Where --simulate's independent points run (:func:`kvtool.fanout.choose_fanout`)."""
    from kvtool.fanout import choose_fanout

    if not simulate:
        for name, value in (("jobs", jobs), ("ray", ray_address)):
            if value is not None:
                raise UsageError(f"{param(name)} runs --simulate's points side by side; data "
                                 f"mode runs them one after the other", field=name)
        return None
    def cluster_ray() -> tuple[str | None, tuple[tuple[str, str], ...]]:
        from kvtool.cluster.state import ray_head_of

        return ray_head_of(clusters)
    return choose_fanout(points, jobs=jobs, ray_address=ray_address, cluster_ray=cluster_ray)


# -- human output -----------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _secs(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _amount(blocks: int | None, nbytes: int | None) -> str:
    if nbytes is not None:
        return format_size(nbytes, binary=False)
    return "–" if blocks is None else f"{blocks:,} blk"


def _render(con: Any, results: list[dict[str, Any]], head: dict[str, Any]) -> None:
    con.print(f"[bold]kvtool replay[/] {head['trace']} ({head['format']}, "
              f"{head['block_tokens']} tokens/block"
              + (f", {format_size(head['block_bytes'], binary=False)}/block"
                 if head["block_bytes"] else "")
              + (f" per rank of {head['block_size']['tp']}"
                 if head.get("block_size") and head["block_size"]["tp"] > 1 else "")
              + f", {head['mode']} mode)")
    if len(results) == 1:
        _render_one(con, results[0], head.get("max_token_hit_ratio"))
    else:
        _render_compare(con, results, head)
    if head["mode"] == "data":
        _render_data(con, results)
        con.print("[dim]Link bytes, seconds and load times are measured (docs/replay.md).[/]")
    tm = results[0]["time_model"]
    if tm.get("basis") == "simulated":
        con.print(f"[dim]Times are simulated: one {tm['model']} engine on {tm['tp']}× "
                  f"{tm['gpu']} under {tm['load']}, this replay's tiers (the serving model's "
                  "one-engine case; docs/replay.md); wall: a round's first arrival to its "
                  "last token.[/]")
        from kvtool.serving.overload import line as overload_line

        for r in results:
            said = overload_line((r.get("time_model") or {}).get("overload"))
            if said:
                con.print(f"[bold yellow]{r['label'] + ': ' if len(results) > 1 else ''}"
                          f"{said}[/]")
    else:
        con.print(f"[dim]No times ({tm.get('why_none')}).[/]")


def _round_header(res: dict[str, Any]) -> str:
    return "minute" if res["round_kind"] == "window" else "round"


def _held(t: dict[str, Any], block_bytes: int | None) -> str:
    """A tier's capacity as configured, and what an unbounded one actually held."""
    if t["capacity_blocks"] is None:
        held = t.get("occupancy_blocks")
        if held is None:
            return "inf"
        return f"inf (held {_amount(held, held * block_bytes if block_bytes else None)})"
    cap = t["capacity_blocks"]
    return _amount(cap, cap * block_bytes if block_bytes else None)


def _render_one(con: Any, res: dict[str, Any], maximum: float | None) -> None:
    from kvtool.cli.output import Column, print_table

    tiers = [t["name"] for t in res["tiers"]]
    block_bytes = res.get("block_bytes")
    cols = [Column(_round_header(res), rank=0), Column("reqs", rank=4),
            Column("hit\nratio", rank=0)]
    cols += [Column(f"hit\n{n}", rank=1) for n in tiers] if len(tiers) > 1 else []
    cols += [Column("recompute\ntokens", rank=2)]
    cols += [Column(f"puts\n{n}", rank=5) for n in tiers]
    cols += [Column(f"promoted\n{n}", rank=6) for n in tiers]
    cols += [Column(f"evicted\n{n}", rank=5) for n in tiers]
    cols += [Column("TTFT\np50", rank=2), Column("TTFT\np99", rank=3),
             Column("wall\n(sim)", rank=4)]

    def cells(r: dict[str, Any]) -> list[str]:
        return ([str(r["requests"]), _pct(r["token_hit_ratio"])]
                + ([_pct(r["hit_ratio_by_tier"][n]) for n in tiers] if len(tiers) > 1 else [])
                + [f"{r['recompute_tokens']:,}"]
                + [_amount(r["put_blocks"][n], r["put_bytes"][n]) for n in tiers]
                + [_amount(r["promoted_blocks"][n], r["promoted_bytes"][n]) for n in tiers]
                + [f"{r['evictions'][n]:,}" for n in tiers]
                + [_secs(r["ttft_p50_s"]), _secs(r["ttft_p99_s"]), _secs(r["wall_s"])])

    rows: list[list[str] | None] = []
    for r in res["rounds"]:
        mark = " ◀ cliff" if r["round"] == res["cliff_round"] else ""
        rows.append([f"{r['round']}{mark}", *cells(r)])
    rows.append(None)
    rows.append(["total", *cells(res)])
    title = (f"{res['label']} · {res['write_policy']}"
             if res["label"] else res["write_policy"])
    print_table(con, cols, rows, title=title, more="--csv FILE has every column")
    cliff = res["cliff_round"]
    kind = _round_header(res)
    con.print(f"token hit ratio [bold]{_pct(res['token_hit_ratio'])}[/]"
              + (f" ({_pct(res['token_hit_ratio'] / maximum)} of the trace's max "
                 f"{_pct(maximum)})" if maximum else "")
              + f" · collapse {kind} "
              + ("[dim]n/a (no rounds)[/]" if kind != "round"
                 else f"[bold red]{cliff}[/]" if cliff is not None else "[green]none[/]")
              + (f" · requests/s (simulated) {res['requests_per_s']:.2f}"
                 if res.get("requests_per_s") else "")
              + (" · [yellow]interrupted[/]" if res.get("interrupted") else ""))
    if any(t["capacity_blocks"] is None for t in res["tiers"]):
        con.print("tiers: " + ", ".join(f"{t['name']} {_held(t, block_bytes)}" for t in res["tiers"]))


def _render_compare(con: Any, results: list[dict[str, Any]], head: dict[str, Any]) -> None:
    from rich import box

    from kvtool.cli.output import Column, print_table

    best = max((r["token_hit_ratio"] for r in results), default=0.0)
    maximum = head.get("max_token_hit_ratio")
    kind = _round_header(results[0])
    rows: list[tuple[str, Any]] = [
        ("token hit ratio", lambda r: _pct(r["token_hit_ratio"])),
        ("% of max" if maximum is not None else "% of best here",
         lambda r: _pct(r["token_hit_ratio"] / (maximum or best)) if (maximum or best) else "–"),
        (f"collapse {kind}", lambda r: "n/a" if kind != "round" else
         "none" if r["cliff_round"] is None else str(r["cliff_round"])),
        ("recompute tokens", lambda r: f"{r['recompute_tokens']:,}"),
        ("written (all tiers)", lambda r: _amount(sum(r["blocks_written"].values()),
                                                  _sum_or_none(r["bytes_written"]))),
        ("evictions (all tiers)", lambda r: f"{sum(r['evictions'].values()):,}"),
        ("TTFT p50", lambda r: _secs(r["ttft_p50_s"])),
        ("TTFT p99", lambda r: _secs(r["ttft_p99_s"])),
        ("wall (simulated)", lambda r: _secs(r["wall_s"])),
    ]
    tier_names = sorted({t["name"] for r in results for t in r["tiers"]},
                        key=("gpu", "dram", "nvme").index)
    for name in tier_names:
        rows.append((name, lambda r, name=name: next(
            (_held(t, r.get("block_bytes")) for t in r["tiers"] if t["name"] == name), "–")))
    keys = [f"[{i + 1}]" for i in range(len(results))]
    cols = [Column("", justify="left")] + [Column(k, rank=1) for k in keys]
    print_table(con, cols, [[name, *[fn(r) for r in results]] for name, fn in rows],
                title="configurations side by side", box=box.SIMPLE_HEAD,
                more="--json has them all")
    for k, r in zip(keys, results, strict=True):
        con.print(f"  {k} {r['label']}")
    if maximum is None:
        con.print("[dim]% of best here: of the best configuration's hit ratio.[/]")
    else:
        con.print(f"[dim]% of max: of {_pct(maximum)}, the trace's hit ratio with unbounded "
                  "tiers (only first uses miss).[/]")
    per_cols = [Column(kind)] + [Column(k, rank=1) for k in keys]
    by_round = [{r["round"]: r for r in res["rounds"]} for res in results]
    per_rows: list[list[str] | None] = []
    for rnd in sorted({k for d in by_round for k in d}):
        cells = []
        for res, d in zip(results, by_round, strict=True):
            row = d.get(rnd)
            mark = " ◀" if rnd == res["cliff_round"] else ""
            cells.append("–" if row is None else _pct(row["token_hit_ratio"]) + mark)
        per_rows.append([str(rnd), *cells])
    print_table(con, per_cols, per_rows, title=f"token hit ratio per {kind}",
                box=box.SIMPLE_HEAD, more="--json has them all")


def _render_data(con: Any, results: list[dict[str, Any]]) -> None:
    """Data mode: bytes per link (measured), content checks, the NVMe medium's counters."""
    from kvtool.cli.output import Column, print_table

    for res in results:
        m = res["measured"]
        print_table(con, [Column("link", justify="left"), Column("blocks"), Column("bytes"),
                          Column("seconds"), Column("GB/s")],
                    [[name, f"{lk['blocks']:,}", format_size(lk["bytes"], binary=False),
                      f"{lk['seconds']:.3f}", "–" if lk["gbps"] is None else f"{lk['gbps']:.2f}"]
                     for name, lk in m["links"].items()],
                    title="measured links" + (f" · {res['label']}" if len(results) > 1 else ""))
        colour = "red" if res["corrupt_blocks"] or res["lost_blocks"] else "green"
        con.print(f"[{colour}]verified {res['verified_blocks']:,} blocks · corrupt "
                  f"{res['corrupt_blocks']:,} · lost {res['lost_blocks']:,} · recomputed "
                  f"{res['recomputed_blocks']:,}[/] · load p50 {_secs(m['load_s']['p50'])} "
                  f"p99 {_secs(m['load_s']['p99'])} (measured) · replay overhead "
                  + ("–" if m["overhead_us_per_block"] is None
                     else f"{m['overhead_us_per_block']:.1f} µs/block")
                  + f" · wall {m['wall_s']:.2f} s")
        for p in res["problems"][:10]:
            con.print(f"  [red]{p['kind']}[/] block {p['key']:#x} in {p['tier']} "
                      f"(round {p['round']}, trace line {p['line']}): recomputed, not served")
        for t_ in res["tiers"]:
            if t_.get("failed"):
                con.print(f"  [red]{t_['name']} tier failed[/]: {t_['failed']}")
        media = res.get("media")
        if media and "error" not in media and not media["counted"]:
            con.print("NVMe medium: its SMART log counted no writes for this namespace (Linux "
                      "nvmet counts only block devices with I/O accounting, not brd or files)")
        elif media and "error" not in media:
            con.print(f"NVMe medium (SMART Data Units Written): "
                      f"{format_size(media['media_bytes_written'], binary=False)} written "
                      f"during the run · replay put {format_size(media['replay_put_bytes'], binary=False)}"
                      f" ({format_size(media['replay_padded_bytes'], binary=False)} padded "
                      f"+ {format_size(media['store_metadata_bytes'], binary=False)} store "
                      "metadata)")


def _sum_or_none(values: dict[str, int | None]) -> int | None:
    if any(v is None for v in values.values()):
        return None
    return sum(v for v in values.values() if v is not None)
