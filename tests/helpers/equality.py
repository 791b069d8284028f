"""Before/after equality of replays (issue 39: "hits, counts and puts stay identical").

A fixed matrix of ``kvtool --json replay --simulate`` runs — every fixture trace under
every policy (with and without the serving model's times), every fixture cluster through
the serving model, and the public Mooncake trace — each reduced to its headline counts
and a digest of the whole report. tests/cache/test_equality.py compares the matrix with
the numbers recorded in tests/cache/equality.json, which were written by the code before
the refactoring (``python tests/helpers/equality.py OUT.json`` with that tree's kvtool
first on PYTHONPATH); a change of model on purpose rewrites that file in the same commit.
The three ``*/times`` cases were rewritten by issue 39's one replay core: their counts are
the recorded ones, their times are now the engine's timing of the tier hierarchy's own
decisions (kvtool.serving.serveorder) instead of a second pass with its own hits.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
SHARED = REPO.parent / "shared"

POLICIES = ("lru", "lru-tail-first", "radix", "prefix-fair", "oracle", "mooncake", "vllm",
            "arc", "s3fifo", "lfu", "vllm-lru", "vllm-arc")
TRACES = {
    "multiturn-8x12": ["fixtures/traces/multiturn-8x12.jsonl"],
    "multiturn-4x6": ["fixtures/traces/multiturn-4x6.tokens.jsonl", "--block-tokens", "16"],
    "bailian": ["fixtures/traces/bailian-sample.jsonl", "--block-tokens", "16"],
}
CLUSTERS = ("a100-llama2", "gp7000", "gp7000-dram", "gp7000-mini", "fx100", "fx100-small-pool",
            "wqs-pd-400-141g", "dynamo-mocker-4x2000")
COUNTS = ("requests", "hit_tokens", "recompute_tokens", "blocks_written", "blocks_read",
          "put_blocks", "promoted_blocks", "evictions", "cliff_round")
TIMES = ("ttft_p50_s", "ttft_p99_s", "wall_s")


def cases(*, mooncake: bool) -> Iterator[tuple[str, list[str]]]:
    """(name, kvtool arguments) of every case."""
    for tname, targs in TRACES.items():
        for policy in POLICIES:
            gpu = "gpu=64blk," if policy == "vllm" else ""
            tiers = ["--compare", f"{gpu}dram=24blk,nvme=120blk,policy={policy}",
                     "--compare", f"{gpu}dram=60blk,policy={policy},write-policy=write-back"]
            if policy == "vllm":
                tiers = ["--gpu", "64blk", "--dram", "40blk", "--policy", "vllm"]
            yield (f"{tname}/{policy}",
                   ["replay", *targs, "--simulate", "--no-times", *tiers])
        yield (f"{tname}/times", ["replay", *targs, "--simulate", "--dram", "24blk",
                                  "--nvme", "120blk"])
    for cluster in CLUSTERS:
        yield (f"cluster/{cluster}",
               ["replay", "fixtures/traces/multiturn-8x12.jsonl", "--simulate", "--cluster",
                f"fixtures/clusters/{cluster}.toml", "--concurrency", "4"])
    if mooncake:
        trace = str(SHARED / "traces" / "mooncake" / "conversation_trace.jsonl")
        yield ("mooncake/conversation", ["replay", trace, "--simulate", "--format", "mooncake",
                                         "--block-tokens", "512", "--dram", "300000tok",
                                         "--nvme", "3000000tok", "--no-times"])
        yield ("mooncake/conversation-prefix-fair",
               ["replay", trace, "--simulate", "--format", "mooncake", "--block-tokens",
                "512", "--dram", "300000tok", "--policy", "prefix-fair", "--no-times"])


def _strip(doc: Any) -> Any:
    """The report without what names the run's paths."""
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in ("trace", "cluster_file")}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Headline counts and times of a report (each configuration's), and a digest of all."""
    heads = []
    if "runs" in doc:  # the serving model's report: per (cluster, load) run
        for r in doc["runs"]:
            heads.append({"label": r["label"], "cache": r["cache"],
                          "duration": r["serving"]["duration"],
                          "mean_ttft_ms": r["serving"]["mean_ttft_ms"]})
    for c in doc.get("configs") or ([] if "runs" in doc else [doc]):
        heads.append({k: c[k] for k in (*COUNTS, *TIMES) if k in c})
    digest = hashlib.sha256(json.dumps(_strip(doc), sort_keys=True).encode()).hexdigest()
    return {"configs": heads, "digest": digest}


def run_case(args: list[str]) -> dict[str, Any]:
    from click.testing import CliRunner

    from kvtool.cli.main import cli

    result = CliRunner().invoke(cli, ["--json", "--quiet", *args], catch_exceptions=False)
    assert result.exit_code == 0, f"{args}: {result.stderr}{result.stdout[-2000:]}"
    return summary(json.loads(result.stdout))


def main(out: str) -> None:
    import os

    os.chdir(REPO)
    mooncake = (SHARED / "traces" / "mooncake" / "conversation_trace.jsonl").exists()
    found = {name: run_case(args) for name, args in cases(mooncake=mooncake)}
    Path(out).write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
