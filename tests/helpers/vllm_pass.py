"""One fresh vLLM engine process over a list of prompts (run in the engine virtualenv).

``python tests/helpers/vllm_pass.py JOB.json``; the job names the model, the connector
(``KvtoolConnector`` with its extra config, vLLM's own ``ExampleConnector``, or none), the
KV cache size and block size, and the prompts (token ids). Prints one JSON line per prompt
(its greedy tokens and cached tokens), then one ``{"end": …}`` line with vLLM's counters
and the kvtool block store's report. With ``"step": true`` it reads a line from stdin
before each prompt, so a test can act between requests (kill a target, corrupt a block),
and each result carries the kvtool block store's report so far;
with ``"reset_prefix_cache": true`` it empties vLLM's own prefix cache between prompts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if not isinstance(value, int | float):
            continue
        source = (getattr(m, "labels", None) or {}).get("source")
        if source is not None:
            out.setdefault(m.name, {})[source] = value
        else:
            out[m.name] = out.get(m.name, 0) + value
    return out


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    # the results go to the original stdout; everything else that writes to stdout (vLLM's
    # logger, C++ extensions) goes to stderr
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kv = None
    if job.get("connector") == "kvtool":
        kv = {"kv_connector": "KvtoolConnector",
              "kv_connector_module_path": "kvtool.integrations.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": job["extra"]}
    elif job.get("connector") == "example":
        kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": job["extra"]["path"]}}
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), skip_tokenizer_init=True,
              enable_prefix_caching=True,
              kv_cache_memory_bytes=int(job.get("gpu_bytes", 64 << 20)), enforce_eager=True,
              seed=0, disable_log_stats=False, max_model_len=int(job.get("max_model_len", 4096)),
              block_size=int(job.get("block_size", 32)), kv_transfer_config=kv)
    sp = SamplingParams(max_tokens=job.get("max_tokens", 8), temperature=0.0,
                        detokenize=False, ignore_eos=True)
    for i, prompt in enumerate(job["prompts"]):
        if job.get("step"):
            sys.stdin.readline()
        if job.get("reset_prefix_cache") and i:
            llm.reset_prefix_cache()  # the next prompt can only hit the connector's tiers
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        doc = {"i": i, "tokens": list(out.outputs[0].token_ids),
               "cached": int(out.num_cached_tokens or 0)}
        if job.get("step") and job.get("connector") == "kvtool":
            from kvtool.integrations.vllm import store_reports

            doc["report"] = (store_reports() or [None])[0]  # the counters so far
        print(json.dumps(doc), file=results, flush=True)
    report = None
    if kv is not None and job.get("connector") == "kvtool":
        from kvtool.integrations.vllm import close_stores, store_reports

        reports = store_reports()
        report = reports[0] if reports else None
        close_stores()
    print(json.dumps({"end": True, "counters": counters(llm), "report": report}), file=results,
          flush=True)
    with contextlib.suppress(Exception):  # the result is out already
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
