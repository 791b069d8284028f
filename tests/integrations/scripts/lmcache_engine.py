"""LMCache's own engine on CPU tensors, with kvtool's plugin as its remote storage.

Run in the engine virtualenv (``kvtool.integrations.venv``; it has torch and LMCache),
by ``tests/integrations/test_lmcache.py``::

    python lmcache_engine.py SPEC.json OUT.json

``SPEC``: ``{"extra": {...}, "config": {...}, "prompts": {"A": {"seed": 1, "tokens": 103}},
"phases": [["store", "A"], ["destroy"], ["build"], ["retrieve", "A"], ...]}``; ``extra``
holds the ``remote_storage_plugin.kvtool.*`` keys (the module path and class name are
added), ``config`` other LMCache settings, ``world_size`` LMCache's (1), ``plugin`` and
``class_name`` the plugin's name and class (``kvtool``, ``KvtoolConnector``). Each phase's
result is written to ``OUT`` as ``[[phase, result, {allocations, seconds}], ...]``
(written after every phase, so a crash leaves what ran).

The GPU is a stand-in: a ``GPUConnectorInterface`` whose "device" is a CPU tensor of
shape (2, layers, tokens, hidden), copied into and out of LMCache's memory objects
(format KV_2LTD). A prompt's KV is random bytes seeded by the prompt, so another process
knows what it must get back. After each phase every memory object LMCache allocated must
have been freed (``local_cpu`` is off: LMCache keeps none cached): ``allocations``.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import os
import signal
import sys
import time
import urllib.request
from typing import Any

import torch
from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

from kvtool.integrations import lmcache as plugin

LAYERS, CHUNK, HEADS, HEAD_SIZE = 2, 32, 2, 16
HIDDEN = HEADS * HEAD_SIZE
INSTANCE = "kvtool-test"


class CpuConnector(GPUConnectorInterface):
    """LMCache's GPU connector, over a CPU tensor passed as ``kv=`` to store/retrieve."""

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        kw["kv"][:, :, start:end, :].copy_(memory_obj.tensor)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        memory_obj.tensor.copy_(kw["kv"][:, :, start:end, :])

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(m, s, e, **kw)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e, **kw)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HIDDEN])


class Run:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        name = spec.get("plugin", "kvtool")
        self.backend_name = f"RemoteBackend-{name}"
        extra = {f"remote_storage_plugin.{name}.module_path": plugin.MODULE,
                 f"remote_storage_plugin.{name}.class_name": spec.get("class_name",
                                                                     "KvtoolConnector")}
        extra.update(spec.get("extra", {}))
        settings = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.05,
                    "remote_serde": "naive", "save_unfull_chunk": True,
                    "pre_caching_hash_algorithm": "sha256_cbor",
                    "remote_storage_plugins": [name], "extra_config": extra}
        settings.update(spec.get("config", {}))
        self.config = LMCacheEngineConfig.from_defaults(**settings)
        world = int(spec.get("world_size", 1))
        self.metadata = LMCacheMetadata(
            model_name="kvtool-tiny", world_size=world, local_world_size=world, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16,
            kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE), chunk_size=CHUNK)
        self.engine: LMCacheEngine | None = None

    # ---------------------------------------------------------------- helpers
    def prompt(self, name: str) -> tuple[list[int], torch.Tensor]:
        p = self.spec["prompts"][name]
        tokens = [p["seed"] * 10_000 + i for i in range(p["tokens"])]
        g = torch.Generator().manual_seed(p["seed"])
        kv = torch.rand((2, LAYERS, len(tokens), HIDDEN), generator=g).to(torch.bfloat16)
        return tokens, kv

    def build(self) -> LMCacheEngine:
        if self.engine is None:
            self.engine = LMCacheEngineBuilder.get_or_create(
                INSTANCE, self.config, self.metadata, CpuConnector(), mock_up_broadcast_fn,
                mock_up_broadcast_object_fn)
            self.engine.post_init()
        return self.engine

    def backend(self) -> Any:
        sm = self.build().storage_manager
        assert sm is not None
        return sm.storage_backends.get(self.backend_name)

    def conn(self) -> plugin.KvtoolConnector:
        rb = self.backend()
        assert rb is not None and rb.connection is not None, "no kvtool remote backend"
        c = rb.connection.getWrappedConnector()
        assert isinstance(c, plugin.KvtoolConnector)
        return c

    def settle(self) -> int:
        """Wait for the puts in flight; return the memory objects still allocated."""
        if self.engine is None:
            return 0
        sm = self.engine.storage_manager
        assert sm is not None
        rb = sm.storage_backends.get(self.backend_name)
        deadline = time.monotonic() + 60
        while rb is not None and rb.put_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        cpu = sm.storage_backends["LocalCPUBackend"]
        alloc = cpu.memory_allocator.pin_allocator
        while alloc.num_active_allocations and time.monotonic() < deadline:
            time.sleep(0.01)
        return int(alloc.num_active_allocations)

    def keys(self, tokens: list[int]) -> list[Any]:
        db = self.build().token_database
        return [k for _s, _e, k in db.process_tokens(tokens=tokens)]

    def on_loop(self, coro: Any) -> Any:
        sm = self.build().storage_manager
        assert sm is not None
        return asyncio.run_coroutine_threadsafe(coro, sm.loop).result(60)

    # ---------------------------------------------------------------- phases
    def phase(self, op: str, *args: Any) -> Any:
        return getattr(self, f"do_{op}")(*args)

    def do_build(self) -> dict[str, Any]:
        self.build()
        rb = self.backend()
        return {"remote_backend": rb is not None and rb.connection is not None}

    def do_destroy(self) -> None:
        LMCacheEngineBuilder.destroy(INSTANCE)
        self.engine = None
        gc.collect()

    def do_store(self, name: str) -> None:
        tokens, kv = self.prompt(name)
        self.build().store(tokens, kv=kv)

    def do_lookup(self, name: str) -> int:
        tokens, _kv = self.prompt(name)
        return int(self.build().lookup(tokens))

    def do_retrieve(self, name: str) -> dict[str, Any]:
        tokens, kv = self.prompt(name)
        dst = torch.zeros_like(kv)
        mask = self.build().retrieve(tokens, kv=dst)
        n = int(mask.sum())
        return {"tokens": n, "prefix": bool(mask[:n].all()),
                "match": bool(torch.equal(dst[:, :, :n], kv[:, :, :n])),
                "rest_untouched": bool((dst[:, :, n:] == 0).all())}

    def do_keys(self, name: str) -> list[dict[str, Any]]:
        tokens, _kv = self.prompt(name)
        out = []
        for k in self.keys(tokens):
            d = plugin.digest(k)
            out.append({"key": k.to_string(), "id": plugin.key_id(d)})
        return out

    def do_report(self) -> dict[str, Any]:
        return self.conn().report()

    def do_list(self) -> list[str]:
        return sorted(self.on_loop(self.conn().list()))

    def do_clear(self, name: str, tokens_n: int) -> int:
        tokens, _kv = self.prompt(name)
        return int(self.build().clear(tokens[:tokens_n]))

    def do_kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def do_exists_sync(self, name: str) -> dict[str, Any]:
        """The synchronous paths: the plugin's exists_sync and LMCache's contains with
        ``use_exists_sync`` (both must give bools, never a coroutine)."""
        tokens, _kv = self.prompt(name)
        c, rb = self.conn(), self.backend()
        got = [c.exists_sync(k) for k in self.keys(tokens)]
        via = [rb.contains(k) for k in self.keys(tokens)]
        return {"plugin": [type(x).__name__ for x in got], "held": got,
                "lmcache": via, "lmcache_types": [type(x).__name__ for x in via]}

    def do_nonblocking(self, name: str, missing: int) -> dict[str, Any]:
        """batched_get_non_blocking with chunk ``missing`` replaced by an unknown key: the
        leading chunks come back, the rest are released."""
        tokens, _kv = self.prompt(name)
        keys = self.keys(tokens)
        keys[missing] = keys[missing].with_new_worker_id(7)
        objs = self.on_loop(self.conn().batched_get_non_blocking("t", keys))
        n = len(objs)
        for o in objs:
            o.ref_count_down()
        return {"served": n}

    def do_collide(self, name: str, other: str) -> dict[str, Any]:
        """Store, under the kvtool key of ``name``'s first chunk, a block whose header
        names another key (what a 64-bit collision would leave): a lookup finds the key,
        the load must refuse it."""
        import numpy as np
        from lmcache.v1.protocol import RemoteMetadata

        c = self.conn()
        key = self.keys(self.prompt(name)[0])[0]
        stranger = self.keys(self.prompt(other)[0])[0]
        data = np.full(c.full_chunk_size_bytes, 7, dtype=np.uint8)
        meta = RemoteMetadata(data.nbytes, self.metadata.get_shapes(),
                              self.metadata.get_dtypes(), c.meta_fmt).serialize()
        row = np.empty(c.object_bytes, dtype=np.uint8)
        plugin.pack(row, plugin.digest(stranger), meta, stranger.to_string(), data)
        kid = plugin.key_id(plugin.digest(key))
        c.store.save([kid], CHUNK, lambda _k: row)
        c.store.commit()
        return {"id": kid}

    def do_metrics(self) -> list[str]:
        port = self.conn().report()["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return [ln for ln in text.splitlines() if ln.startswith("kvtool_lmcache")]

    def do_sleep(self, seconds: float) -> None:
        time.sleep(seconds)


HANG_S = 240
"""A run that takes longer is stuck: every thread's stack is dumped and it exits."""


def main() -> int:
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out_path = sys.argv[2]
    run = Run(spec)
    results: list[Any] = []
    try:
        for phase in spec["phases"]:
            t0 = time.monotonic()
            result = run.phase(*phase)
            results.append([phase, result, {"allocations": run.settle(),
                                            "seconds": round(time.monotonic() - t0, 3)}])
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:  # LMCache's threads would keep a failed run alive
        if run.engine is not None:
            run.do_destroy()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
