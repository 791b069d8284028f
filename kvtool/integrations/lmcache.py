"""kvtool's tiers under LMCache: a remote storage plugin.

::

    # lmcache.yaml (LMCACHE_CONFIG_FILE)
    chunk_size: 256
    remote_serde: naive
    remote_storage_plugins: ["kvtool"]
    extra_config:
      remote_storage_plugin.kvtool.module_path: kvtool.integrations.lmcache
      remote_storage_plugin.kvtool.class_name: KvtoolConnector
      remote_storage_plugin.kvtool.url: nvme+tcp://10.0.0.5:4420/nqn.2026-01.io.kvtool:kv/1
      remote_storage_plugin.kvtool.hostnqn: nqn.2014-08.org.nvmexpress:uuid:…
      remote_storage_plugin.kvtool.dhchap_secret: /etc/kvtool/host.key
      remote_storage_plugin.kvtool.dram: 4GiB@/dev/shm/kvtool-lmcache

``url`` is the NVMe tier's place (an ``nvme+tcp://`` namespace, a block device or a file,
optionally ``SIZE@PLACE``); every other ``remote_storage_plugin.kvtool.<key>`` is a tier
word of :mod:`kvtool.integrations.spec` (``dram``, ``policy``, ``tiers``, ``hostnqn``,
``dhchap_secret``, ``dhchap_ctrl_secret``, ``read_qd``, ``reformat``, ``on_tier_error``,
``metrics_port``). ``class_name`` may also be ``KvtoolAdapter``, which serves plugins named
``kvtool.<instance>`` (several kvtool stores under one engine). Pinned against
``lmcache`` 0.5.6 (``pip install 'kvtool[lmcache]'``); docs/integrations.md, "LMCache".

How it stores (:class:`~kvtool.integrations.blockstore.BlockStore`, the tiers of
``kvtool replay``'s data mode):

* **One block per LMCache chunk**, of one fixed object size: a header of
  :data:`HEADER_BYTES` (a 16-byte BLAKE2b digest of the full ``CacheEngineKey`` string,
  LMCache's remote metadata — length, shapes, dtypes, format — and the key string), then
  the chunk's bytes, zero-padded to a multiple of 4 KiB. A partial last chunk round-trips
  with its own shape. The block's kvtool key is the digest's first 8 bytes; a 64-bit
  collision is caught by the full digest and is a miss.
* **Every load is checked**: BlockStore's CRC32C of the whole block, then the header. A
  block that fails is a miss (LMCache recomputes the chunk; the next store of it rewrites
  the bad copy). A tier whose medium fails (the target is down) is dropped: its chunks are
  misses, and nothing is raised into LMCache.
* **Durable**: each put is committed through the object store's crash-consistent
  protocol before it completes; a new process reopens the store with its index (the same
  model, dtype, chunk size and world size, else it is refused unless ``reformat``).
* **LMCache's rules** (pitfalls a published plugin fell into: docs/integrations.md): ``exists_sync`` is a
  plain function; ``put`` never releases the caller's memory object (LMCache's wrapper
  does), and a memory object ``get`` allocated is released when it is not returned;
  blocking I/O runs on the plugin's own threads, never on LMCache's event loop; an error
  is logged once per operation, counted (:meth:`KvtoolConnector.report`) and, for a put,
  raised to LMCache, which logs it too.

With tensor parallelism each rank is its own LMCache engine: put ``{rank}`` in the places
(one namespace or pool file per rank: LMCache's worker id).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from lmcache.logging import init_logger
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvtool.errors import UsageError
from kvtool.integrations.blockstore import BlockStore
from kvtool.integrations.spec import KEYS, StoreSpec
from kvtool.store.layout import Geometry

if TYPE_CHECKING:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.storage_backend.connector import ConnectorContext

log = init_logger(__name__)
"""The plugin logs through LMCache's logging (its format, its LMCACHE_LOG_LEVEL)."""

PLUGIN_TYPE = "kvtool"
"""LMCache plugin names this module serves through :class:`KvtoolAdapter`: ``kvtool`` and
``kvtool.<instance>`` (LMCache's ``{type}.{instance}`` convention)."""
MODULE = __name__
SCHEMA = "kvtool.lmcache/1"

MAGIC = b"kvtLMC01"
_HEAD = struct.Struct("<8s16sQII")
"""magic, digest of the key string, data bytes, metadata bytes, key string bytes."""
HEADER_BYTES = 1024
"""The header in front of each chunk's bytes (the key string is kept when it fits)."""
ALIGN = 4096
BATCH = 16
"""Chunks one :meth:`BlockStore.save` takes (a larger batch is saved in pieces)."""
THREADS = 2
"""Threads doing the plugin's blocking work (BlockStore serializes its calls)."""

_T = TypeVar("_T")


def digest(key: CacheEngineKey) -> bytes:
    """16 bytes naming ``key`` (its full string: model, world size, worker, chunk hash,
    dtype, tags)."""
    return blake2b(key.to_string().encode(), digest_size=16).digest()


def key_id(d: bytes) -> int:
    """The kvtool block key of a digest (its first 8 bytes; never 0)."""
    return int.from_bytes(d[:8], "little") or 1


def plugin_values(extra_config: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """The ``remote_storage_plugin.NAME.*`` keys of LMCache's ``extra_config``, as tier
    words (``url`` is the NVMe tier; ``module_path`` and ``class_name`` are LMCache's)."""
    prefix = f"remote_storage_plugin.{name}."
    out: dict[str, Any] = {}
    for k, v in (extra_config or {}).items():
        if not isinstance(k, str) or not k.startswith(prefix):
            continue
        word = k[len(prefix):]
        if word in ("module_path", "class_name"):
            continue
        if word == "url":
            if "nvme" in out or f"{prefix}nvme" in (extra_config or {}):
                raise UsageError("give the NVMe tier once: url or nvme, not both",
                                 field=f"{prefix}url")
            word = "nvme"
        if word == "commit_interval":  # a vLLM connector's steps; here every put commits
            raise UsageError("each put is durable when it returns: commit_interval is the "
                             "vLLM connector's", field=k)
        if word not in KEYS:
            raise UsageError(f"unknown key {word!r} (use url, "
                             f"{', '.join(w for w in KEYS if w != 'commit_interval')})",
                             field=k)
        out[word] = v
    return out


def parse_spec(extra_config: dict[str, Any] | None, name: str) -> StoreSpec:
    """The plugin's tiers, from LMCache's ``extra_config`` (errors name the key as it is
    spelled there)."""
    prefix = f"remote_storage_plugin.{name}."
    values = plugin_values(extra_config, name)
    via_url = "nvme" in values and f"{prefix}url" in (extra_config or {})
    try:
        return StoreSpec.parse(values, where=prefix)
    except UsageError as exc:
        if via_url and exc.field == f"{prefix}nvme":
            exc.rename_field(f"{prefix}url")
        raise


def plugin_name_of(config: Any, class_name: str) -> str:
    """The name of the plugin ``config`` loads this module's ``class_name`` for (LMCache
    does not tell a ``RemoteConnector`` subclass its name)."""
    extra = getattr(config, "extra_config", None) or {}
    names = [n for n in (getattr(config, "remote_storage_plugins", None) or [])
             if extra.get(f"remote_storage_plugin.{n}.module_path") == MODULE
             and extra.get(f"remote_storage_plugin.{n}.class_name") == class_name]
    if len(names) != 1:
        found = ", ".join(names) or "none"
        raise UsageError(f"remote_storage_plugins names {found} with module_path {MODULE} "
                         f"and class_name {class_name}: name exactly one, or use class_name "
                         "KvtoolAdapter with plugins named kvtool.<instance>",
                         field="remote_storage_plugins")
    return str(names[0])


# ---------------------------------------------------------------------- the header
def pack(row: np.ndarray, d: bytes, meta: bytes, key_text: str, data: np.ndarray) -> None:
    """Write one chunk's block into ``row`` (zeroed beyond the data)."""
    kb = key_text.encode()
    if _HEAD.size + len(meta) + len(kb) > HEADER_BYTES:
        kb = b""  # not listable by name; the digest still names it
    head = _HEAD.pack(MAGIC, d, data.nbytes, len(meta), len(kb)) + meta + kb
    row[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    row[len(head):HEADER_BYTES] = 0
    end = HEADER_BYTES + data.nbytes
    row[HEADER_BYTES:end] = data
    row[end:] = 0


def unpack(row: np.ndarray) -> tuple[bytes, int, bytes, str] | None:
    """(digest, data bytes, metadata, key string) of a block, None when it is not one."""
    magic, d, n, m, k = _HEAD.unpack_from(row.data, 0)
    if (magic != MAGIC or _HEAD.size + m + k > HEADER_BYTES
            or HEADER_BYTES + n > row.nbytes):
        return None
    at = _HEAD.size
    meta = row[at:at + m].tobytes()
    text = row[at + m:at + m + k].tobytes().decode(errors="replace")
    return d, n, meta, text


class _Errors:
    """Errors per operation: counted, the first of each logged with its traceback."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, op: str, exc: BaseException) -> None:
        with self._lock:
            n = self.counts[op] = self.counts.get(op, 0) + 1
        if n == 1:
            log.error("kvtool LMCache plugin: %s failed (logged once; counted in its "
                      "report): %s", op, exc, exc_info=exc)
        else:
            log.debug("kvtool LMCache plugin: %s failed again: %s", op, exc)


# ---------------------------------------------------------------------- the connector
class KvtoolConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over kvtool's tiers (module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any = None, plugin_name: str | None = None) -> None:
        config = config if config is not None else local_cpu_backend.config
        metadata = local_cpu_backend.metadata
        super().__init__(config, metadata)
        try:
            self._open(loop, local_cpu_backend, config, metadata, plugin_name)
        except Exception as exc:  # LMCache logs a warning only, and goes on without us
            log.error("kvtool LMCache plugin %s cannot start (no chunk will be stored): %s",
                      getattr(self, "plugin_name", None) or plugin_name or "", exc)
            raise

    def _open(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
              metadata: Any, plugin_name: str | None) -> None:
        name = plugin_name or plugin_name_of(config, type(self).__name__)
        self.plugin_name = name
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.chunk_tokens = int(getattr(metadata, "chunk_size", 0) or config.chunk_size)
        self.rank = int(metadata.worker_id)
        spec = parse_spec(config.extra_config, name)
        if int(metadata.world_size) > 1 and not _per_rank(spec):
            raise UsageError(f"world size {metadata.world_size}: each rank needs its own "
                             "namespace or pool file: put {rank} in the places (example: "
                             "nvme+tcp://HOST:4420/nqn.2026-01.io.kvtool:kv-{rank}/1)",
                             field=f"remote_storage_plugin.{name}.url")
        self.spec = spec.for_rank(self.rank)
        if self.remote_metadata_bytes + _HEAD.size > HEADER_BYTES:
            raise UsageError(f"LMCache's chunk metadata ({self.remote_metadata_bytes} B) "
                             f"does not fit the {HEADER_BYTES}-byte header",
                             field="remote_storage_plugins")
        self.object_bytes = -(-(HEADER_BYTES + self.full_chunk_size_bytes) // ALIGN) * ALIGN
        """Bytes of one block: the header and a full chunk, padded to 4 KiB."""
        self.identity = Geometry(model=str(metadata.model_name),
                                 dtype=str(metadata.kv_dtype).replace("torch.", ""),
                                 block_tokens=self.chunk_tokens,
                                 tp=int(metadata.world_size))
        self.store = BlockStore(self.spec, block_bytes=self.object_bytes,
                                block_tokens=self.chunk_tokens, request_blocks=BATCH,
                                identity=self.identity, on_event=log.warning)
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix=f"kvtool-lmcache-{name}")
        self._names: dict[int, str] = {}
        """Block key → the CacheEngineKey string it stores (those this process has seen)."""
        self._count_lock = threading.Lock()
        self.counts = {"put_chunks": 0, "put_bytes": 0, "get_chunks": 0, "hit_chunks": 0,
                       "hit_bytes": 0, "miss_chunks": 0, "bad_chunks": 0,
                       "mismatched_chunks": 0, "no_memory_chunks": 0, "removed_chunks": 0}
        self.errors = _Errors()
        self.closed = False
        self._metrics: Any = None
        if self.spec.metrics_port is not None:
            try:
                self._metrics = _serve_metrics(self, self.spec.metrics_port)
            except BaseException:
                self.store.close()
                raise
        rep = self.store.report()
        log.info("kvtool LMCache plugin %s (rank %d): %s; %d-byte blocks of %d tokens",
                 name, self.rank, ", ".join(
                     f"{t['name']} {t['backend']} {t['url'] or ''} ({t['slots']} blocks, "
                     f"{t['reopened_blocks']} found)" for t in rep["tiers"]),
                 self.object_bytes, self.chunk_tokens)

    # ------------------------------------------------------------------ helpers
    def _count(self, **add: int) -> None:
        with self._count_lock:
            for k, v in add.items():
                self.counts[k] += v

    async def _in_thread(self, fn: Callable[..., _T], *args: Any,
                         release: Callable[[_T], None] | None = None) -> _T:
        """``fn(*args)`` on the plugin's threads (LMCache's loop goes on meanwhile). If the
        caller is cancelled while it runs, ``release`` gets its result when it comes."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if release is not None:
                def done(f: asyncio.Future[_T]) -> None:
                    if not f.cancelled() and f.exception() is None:
                        release(f.result())
                fut.add_done_callback(done)
            raise

    def _open_or_raise(self) -> None:
        if self.closed:
            raise RuntimeError(f"kvtool LMCache plugin {self.plugin_name} is closed")

    def _ids(self, keys: Sequence[CacheEngineKey]) -> tuple[list[bytes], list[int]]:
        ds = [digest(k) for k in keys]
        return ds, [key_id(d) for d in ds]

    # ------------------------------------------------------------------ lookups
    def _held_prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading ``keys`` a live tier holds."""
        _ds, ids = self._ids(keys)
        return len(self.store.lookup(ids))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """Whether a live tier holds ``key`` (synchronous, as LMCache's contract says)."""
        try:
            return self._held_prefix([key]) == 1
        except Exception as exc:
            self.errors("exists", exc)
            return False

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._in_thread(self.exists_sync, key)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading ``keys`` a live tier holds (synchronous)."""
        try:
            return self._held_prefix(keys)
        except Exception as exc:
            self.errors("contains", exc)
            return 0

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await self._in_thread(self.batched_contains, keys)

    # ------------------------------------------------------------------ loads
    def _get_many(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """Load ``keys`` (each independently); None for each one not served."""
        n = len(keys)
        out: list[MemoryObj | None] = [None] * n
        self._count(get_chunks=n)
        try:
            ds, ids = self._ids(keys)
            where: list[str] = []
            pos: list[int] = []
            for i, kid in enumerate(ids):
                w = self.store.lookup([kid])
                if w:
                    where.append(w[0])
                    pos.append(i)
            self._count(miss_chunks=n - len(pos))
            good: list[int] = []
            tokens = 0
            if not pos:
                return out
            rows = np.empty((len(pos), self.object_bytes), dtype=np.uint8)
            ok = self.store.load([ids[i] for i in pos], where, list(rows))
            for r, (i, fine) in enumerate(zip(pos, ok, strict=True)):
                if not fine:
                    self._count(bad_chunks=1)
                    continue
                obj = self._to_memory_obj(keys[i], ds[i], rows[r])
                if obj is None:
                    continue
                out[i] = obj
                good.append(r)
                tokens += max(1, obj.get_size() // self.single_token_size)
        except Exception as exc:
            self.errors("get", exc)
            _release(out)
            return [None] * n
        if good:
            # an access: the tiers' policies see it (touch, and promotion into an upper
            # tier that lacks the chunk); the chunks are served even if this fails
            gids = [ids[pos[r]] for r in good]
            row_of = {ids[pos[r]]: rows[r] for r in good}
            try:
                self.store.save(gids, tokens, row_of.__getitem__)
                self.store.commit()
            except Exception as exc:
                self.errors("touch", exc)
        return out

    def _to_memory_obj(self, key: CacheEngineKey, d: bytes, row: np.ndarray
                       ) -> MemoryObj | None:
        """The chunk a checked block holds, in a memory object of LMCache's allocator
        (None: not this key's, or no memory)."""
        head = unpack(row)
        if head is None or head[0] != d or len(head[2]) != self.remote_metadata_bytes:
            self._count(mismatched_chunks=1)  # a 64-bit key collision, or not a chunk
            return None
        _d, nbytes, meta_bytes, text = head
        meta = RemoteMetadata.deserialize(meta_bytes)
        if meta.length != nbytes:
            self._count(mismatched_chunks=1)
            return None
        obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt,
                                              busy_loop=False)
        if obj is None:
            self._count(no_memory_chunks=1)
            return None
        try:
            # byte_array is a memoryview of another format than a uint8 array's: copy
            # through numpy (slice assignment between the two fails)
            dst = np.frombuffer(obj.byte_array, dtype=np.uint8)
            if dst.nbytes != nbytes:
                raise ValueError(f"LMCache allocated {dst.nbytes} B for a {nbytes}-byte chunk")
            np.copyto(dst, row[HEADER_BYTES:HEADER_BYTES + nbytes])
        except BaseException:
            obj.ref_count_down()  # ours: allocated above and not returned
            raise
        if text:
            self._names[key_id(d)] = text
        self._count(hit_chunks=1, hit_bytes=nbytes)
        return obj

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        got = await self._in_thread(self._get_many, [key], release=_release)
        return got[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._in_thread(self._get_many, list(keys), release=_release)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading chunks served, up to the first that is not (the others are
        released)."""
        got = await self._in_thread(self._get_many, list(keys), release=_release)
        out: list[MemoryObj] = []
        for i, obj in enumerate(got):
            if obj is None:
                _release(got[i:])
                break
            out.append(obj)
        return out

    # ------------------------------------------------------------------ stores
    def _put_many(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        """Store each chunk as one block, then commit. The memory objects are the
        caller's: each one's reference taken by the caller is dropped here."""
        try:
            n = len(keys)
            rows = np.empty((n, self.object_bytes), dtype=np.uint8)
            ds, ids = self._ids(keys)
            meta_room = self.remote_metadata_bytes
            tokens = []
            total = 0
            for i, (key, obj) in enumerate(zip(keys, objs, strict=True)):
                data = np.frombuffer(obj.byte_array, dtype=np.uint8)
                if HEADER_BYTES + data.nbytes > self.object_bytes:
                    raise ValueError(f"a chunk of {data.nbytes:,} B does not fit a "
                                     f"{self.object_bytes:,}-byte block")
                meta = RemoteMetadata(data.nbytes, obj.get_shapes(), obj.get_dtypes(),
                                      obj.get_memory_format()).serialize()
                assert len(meta) == meta_room
                text = key.to_string()
                pack(rows[i], ds[i], meta, text, data)
                self._names[ids[i]] = text
                tokens.append(max(1, data.nbytes // self.single_token_size))
                total += data.nbytes
        finally:
            for obj in objs:
                obj.ref_count_down()  # the reference _take() added for this thread
        row_of = dict(zip(ids, rows, strict=True))
        for at in range(0, n, BATCH):
            part = ids[at:at + BATCH]
            self.store.save(part, sum(tokens[at:at + BATCH]), row_of.__getitem__)
        self.store.commit()
        self._count(put_chunks=n, put_bytes=total)

    def _put_checked(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        try:
            self._put_many(keys, objs)
        except Exception as exc:
            self.errors("put", exc)
            raise

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Store one chunk (durable on return). LMCache's wrapper releases
        ``memory_obj`` once this returns; this never does."""
        self._open_or_raise()
        _take([memory_obj])
        await self._in_thread(self._put_checked, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]
                          ) -> None:
        self._open_or_raise()
        _take(memory_objs)
        await self._in_thread(self._put_checked, list(keys), list(memory_objs))

    # ------------------------------------------------------------------ the rest
    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Drop ``key`` from every tier (durable before it returns)."""
        try:
            _ds, ids = self._ids([key])
            n = self.store.remove(ids)
            if n:
                self.store.commit()
                self._count(removed_chunks=n)
            return n > 0
        except Exception as exc:
            self.errors("remove", exc)
            return False

    def _list(self) -> list[str]:
        held = self.store.held()
        unknown = [k for k in held if k not in self._names]
        for at in range(0, len(unknown), BATCH):
            part = unknown[at:at + BATCH]
            where = [self.store.lookup([k]) for k in part]
            live = [(k, w[0]) for k, w in zip(part, where, strict=True) if w]
            if not live:
                continue
            rows = np.empty((len(live), self.object_bytes), dtype=np.uint8)
            ok = self.store.load([k for k, _w in live], [w for _k, w in live], list(rows))
            for (k, _w), row, fine in zip(live, rows, ok, strict=True):
                head = unpack(row) if fine else None
                if head is not None and head[3] and key_id(head[0]) == k:
                    self._names[k] = head[3]
        return [self._names[k] for k in held if k in self._names]

    async def list(self) -> list[str]:
        """The key strings of every chunk held (those stored by an earlier process are
        read from their blocks' headers)."""
        try:
            return await self._in_thread(self._list)
        except Exception as exc:
            self.errors("list", exc)
            return []

    def report(self) -> dict[str, Any]:
        """The plugin's counters and its block store's report (schema :data:`SCHEMA`)."""
        with self._count_lock:
            counts = dict(self.counts)
        return {"schema": SCHEMA, "plugin": self.plugin_name, "rank": self.rank,
                "object_bytes": self.object_bytes, "chunk_tokens": self.chunk_tokens,
                **counts, "errors": dict(self.errors.counts),
                "metrics_port": self._metrics.server_port if self._metrics else None,
                "store": self.store.report()}

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.store.close()
        finally:
            if self._metrics is not None:
                self._metrics.shutdown()
                self._metrics.server_close()

    async def close(self) -> None:
        """Complete and commit what is in flight, close the tiers (idempotent)."""
        try:
            await self._in_thread(self._close)
        finally:
            self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"<KvtoolConnector {self.plugin_name} rank {self.rank}>"


class KvtoolAdapter(ConnectorAdapter):
    """LMCache ``ConnectorAdapter`` for plugins named ``kvtool`` or ``kvtool.<instance>``
    (``class_name: KvtoolAdapter``): it is given the plugin's name, so one engine may have
    several kvtool stores, each configured under its own name."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        if not url.startswith("plugin://"):
            return False
        return url[len("plugin://"):].split(".", 1)[0] == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> KvtoolConnector:
        name = context.plugin_name or context.url[len("plugin://"):]
        return KvtoolConnector(context.loop, context.local_cpu_backend, context.config,
                               plugin_name=name)


# ---------------------------------------------------------------------- helpers
def _per_rank(spec: StoreSpec) -> bool:
    """Whether every durable place of ``spec`` names the rank (local pools need none; a
    Mooncake pool may be shared: LMCache's keys name the worker)."""
    return all(p.startswith("mooncake://") for p in spec.unranked_places())


def _take(objs: Sequence[MemoryObj]) -> None:
    """A reference for the plugin's thread, dropped once it has copied the bytes (so a
    cancelled put cannot free them under it)."""
    for obj in objs:
        obj.ref_count_up()


def _release(objs: Sequence[MemoryObj | None]) -> None:
    """Drop the references of memory objects that will not be handed to LMCache."""
    for obj in objs:
        if obj is not None:
            with contextlib.suppress(Exception):
                obj.ref_count_down()


def _serve_metrics(conn: KvtoolConnector, port: int) -> Any:
    """Serve the plugin's counters on 127.0.0.1:``port`` (0: any free port) from a
    registry of its own, read from :meth:`KvtoolConnector.report` at each scrape; returns
    the HTTP server (``shutdown`` stops it)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector as CollectorBase

    class Collector(CollectorBase):
        def collect(self) -> Iterator[Any]:
            rep = conn.report()
            labels = ["plugin", "rank"]
            who = [conn.plugin_name, str(conn.rank)]
            chunks = CounterMetricFamily("kvtool_lmcache_chunks", "LMCache chunks by "
                                         "operation and result", labels=[*labels, "result"])
            for key in ("put", "get", "hit", "miss", "bad", "mismatched", "no_memory",
                        "removed"):
                chunks.add_metric([*who, key], rep[f"{key}_chunks"])
            yield chunks
            nbytes = CounterMetricFamily("kvtool_lmcache_bytes", "LMCache chunk bytes "
                                         "stored and served", labels=[*labels, "op"])
            nbytes.add_metric([*who, "put"], rep["put_bytes"])
            nbytes.add_metric([*who, "hit"], rep["hit_bytes"])
            yield nbytes
            errors = CounterMetricFamily("kvtool_lmcache_errors", "Plugin operations that "
                                         "failed", labels=[*labels, "op"])
            for op, n in rep["errors"].items():
                errors.add_metric([*who, op], n)
            yield errors
            held = GaugeMetricFamily("kvtool_lmcache_tier_blocks", "Blocks a tier holds",
                                     labels=[*labels, "tier"])
            failed = GaugeMetricFamily("kvtool_lmcache_tier_failed", "1 when a tier's "
                                       "medium failed (its chunks are misses)",
                                       labels=[*labels, "tier"])
            moved = CounterMetricFamily("kvtool_lmcache_tier_bytes", "Bytes stored into "
                                        "and loaded from a tier", labels=[*labels, "tier", "op"])
            for t in rep["store"]["tiers"]:
                held.add_metric([*who, t["name"]], t["held_blocks"])
                failed.add_metric([*who, t["name"]], 1 if t["failed"] else 0)
                moved.add_metric([*who, t["name"], "store"], t["stored_bytes"])
                moved.add_metric([*who, t["name"], "load"], t["loaded_bytes"])
            yield held
            yield failed
            yield moved
            checks = CounterMetricFamily("kvtool_lmcache_checked_blocks", "Blocks loaded "
                                         "and checked (CRC32C)", labels=[*labels, "result"])
            for k in ("verified", "corrupt", "lost"):
                checks.add_metric([*who, k], rep["store"][f"{k}_blocks"])
            yield checks

    registry = CollectorRegistry()
    registry.register(Collector())
    try:
        server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        raise UsageError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}",
                         field=f"remote_storage_plugin.{conn.plugin_name}.metrics_port"
                         ) from None
    return server
