"""A small random-weight Llama checkpoint, so a real engine runs on any box.

**Not a real model**: its weights are random (seeded), it has no tokenizer, and what it
generates means nothing. It exercises everything a KV-cache tier sees of a real one —
vLLM's scheduler, paged KV cache, prefix cache and connector API, KV blocks of a real
layout — in a few MB, without a download (this machine kind reaches no model hub).

The geometry (:data:`CONFIG`): 2 layers, 2 query heads and 1 KV head of 64 dims, a
vocabulary of 1,024, and room for 32k-token prompts: small enough that a 100-request
multi-turn trace runs in CI on one CPU thread. Its weights are float32 and kvtool runs it
in float32 (``dtype="float32"``: vLLM's CPU build would cast to bfloat16), 1 KiB of KV per
token (a 256-token block is 256 KiB): KV computed in other chunks or batches then differs
from a recomputation only in float32 rounding, which greedy decoding of a random model
does not notice, so ``--check-outputs`` can ask for identical tokens (in bfloat16, 3–5 of
the 96 requests of fixtures/traces/multiturn-8x12.jsonl drifted apart after 9–245
tokens). Made once with
transformers (the ``vllm`` extra brings it) under the cache directory, keyed by a digest
of its config and seed, in a child process (``python -m kvtool.integrations.tinymodel
DIR``: torch stays out of the caller); an ``flock`` keeps two processes from making it at
once, and it appears whole or not at all.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from hashlib import blake2b
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32768,
}
SEED = 0
DTYPE = "float32"
MARKER = "kvtool-model.json"
"""The file that labels the checkpoint (and says it is complete)."""


def digest() -> str:
    text = json.dumps({"config": CONFIG, "seed": SEED, "dtype": DTYPE}, sort_keys=True)
    return blake2b(text.encode(), digest_size=6).hexdigest()


def default_dir() -> Path:
    env = os.environ.get("KVTOOL_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(env) if env else (Path(xdg) if xdg else Path.home() / ".cache") / "kvtool"
    return base / "models" / f"tiny-llama-{digest()}"


def is_tiny(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint this module made (not a real model)."""
    try:
        return json.loads((Path(path) / MARKER).read_text()).get("kind") == "tiny-random"
    except (OSError, ValueError):
        return False


def tiny_model(path: str | Path | None = None) -> Path:
    """The checkpoint's directory, made first (in a child process) if missing."""
    import subprocess
    import sys

    out = Path(path) if path is not None else default_dir()
    if (out / MARKER).exists():
        return out
    proc = subprocess.run([sys.executable, "-m", "kvtool.integrations.tinymodel", str(out)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not (out / MARKER).exists():
        lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
        raise RuntimeError(f"could not make the tiny model in {out}: "
                           f"{lines[-1] if lines else 'no error output'}")
    return out


def make(out: Path) -> Path:
    """Make the checkpoint in ``out`` (needs torch and transformers)."""
    if (out / MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / MARKER).exists():
            return out
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        from kvtool.integrations.torchextras import hide_unloadable

        hide_unloadable()  # transformers imports torchvision when it is installed
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(SEED)
        cfg = LlamaConfig(**CONFIG)
        model = LlamaForCausalLM(cfg).to(getattr(torch, DTYPE))
        model.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({
            "kind": "tiny-random", "label": "not a real model: random weights (seeded), "
            "no tokenizer; made by kvtool to run a real engine on any box",
            "config": CONFIG, "seed": SEED, "dtype": DTYPE, "digest": digest(),
            "kv_bytes_per_token": kv_bytes_per_token()}, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def kv_bytes_per_token(dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token."""
    c = CONFIG
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * dtype_bytes


if __name__ == "__main__":
    import sys

    make(Path(sys.argv[1]))
