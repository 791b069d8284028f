"""A Mooncake Store client for KV blocks (``pip install 'kvtool[mooncake]'``).

One :class:`MooncakeClient` per process: it joins the pool at a ``mooncake://`` URL,
contributes ``segment_bytes`` of its own memory to the pool (every client of a Mooncake
pool does: that is how the DRAM pool grows across machines) and moves bytes over the TCP
transport. Reads go into a registered buffer (zero copy, the fast path measured in
docs/mooncake.md).

The master evicts on its own (lease-based approximate LRU from 90 % full): a ``get`` may
find nothing for a key that was put earlier. Callers must treat that as a miss.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from kvtool.errors import InputError, UsageError
from kvtool.mooncake.url import MooncakeUrl, parse_mooncake_url

DEFAULT_SEGMENT_BYTES = 512 << 20
DEFAULT_BUFFER_BYTES = 64 << 20


class MooncakeError(InputError):
    """The pool refused an operation (exit 2 at the CLI: usually no pool is up)."""


def _listening(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host.strip("[]"), port), timeout=2):
            return True
    except OSError:
        return False


def _import_store() -> Any:
    # glog's INFO lines (and one harmless "metadata not found" on first setup) would
    # drown kvtool's output; warnings and errors still show.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "3")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise UsageError("Mooncake Store is not installed: pip install 'kvtool[mooncake]' "
                         f"(Debian also needs libibverbs1) ({exc})", field="dram") from None
    return MooncakeDistributedStore


class MooncakeClient:
    """put / get_into / exists / remove of byte objects in a Mooncake pool."""

    def __init__(self, url: str | MooncakeUrl, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 local_hostname: str | None = None) -> None:
        """``local_hostname``: the address other clients reach this one's segment at (a
        cluster node's); default 127.0.0.1 for a pool on loopback, else the master's host."""
        self.url = url if isinstance(url, MooncakeUrl) else parse_mooncake_url(url)
        store_cls = _import_store()
        # Mooncake retries a missing master for about 90 s; say so at once instead.
        for what, host, port in (("master", self.url.host, self.url.port),
                                 ("metadata server", self.url.metadata_host,
                                  self.url.metadata_port)):
            if not _listening(host, port):
                raise MooncakeError(f"no Mooncake {what} listens at {host}:{port} ({self.url}); "
                                    "start one with kvtool pool up (kvtool pool status)",
                                    field="dram")
        self._store = store_cls()
        if local_hostname is None:
            local_hostname = ("127.0.0.1" if self.url.host in ("127.0.0.1", "localhost")
                              else self.url.host)
        rc = self._store.setup(local_hostname, self.url.metadata_url, segment_bytes,
                               buffer_bytes, "tcp", "", self.url.master)
        if rc != 0:
            raise MooncakeError(f"cannot join the Mooncake pool at {self.url} (setup returned "
                                f"{rc}); is it up? (kvtool pool up; kvtool pool status)",
                                field="dram")
        self._registered: dict[int, int] = {}
        self._closed = False

    def register(self, buf: np.ndarray) -> None:
        """Register ``buf`` (kept alive by the caller) for zero-copy :meth:`get_into`."""
        addr = buf.ctypes.data
        if addr not in self._registered:
            rc = self._store.register_buffer(addr, buf.nbytes)
            if rc != 0:
                raise MooncakeError(f"register_buffer failed ({rc})")
            self._registered[addr] = buf.nbytes

    def put(self, key: str, data: np.ndarray | bytes | memoryview) -> None:
        if isinstance(data, np.ndarray):
            addr = data.ctypes.data
            if addr in self._registered:
                rc = self._store.put_from(key, addr, data.nbytes)
            else:
                rc = self._store.put(key, data.tobytes())
        else:
            rc = self._store.put(key, bytes(data))
        if rc != 0:
            raise MooncakeError(f"put {key!r} failed ({rc}): the pool may be full or down")

    def get_into(self, key: str, out: np.ndarray) -> int:
        """Read ``key`` into ``out`` (registered or not); bytes read, 0 when absent."""
        addr = out.ctypes.data
        if addr in self._registered:
            n = int(self._store.get_into(key, addr, out.nbytes))
            return max(n, 0)
        data = self._store.get(key)
        if not data:
            return 0
        n = min(len(data), out.nbytes)
        out.view(np.uint8).reshape(-1)[:n] = np.frombuffer(data, dtype=np.uint8, count=n)
        return n

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Put objects from registered memory; per key 0 or a Mooncake error code."""
        return list(self._store.batch_put_from(keys, ptrs, sizes))

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Read objects into registered memory; per key the bytes read (≤ 0: absent)."""
        return [int(n) for n in self._store.batch_get_into(keys, ptrs, sizes)]

    def batch_remove(self, keys: list[str]) -> None:
        """:meth:`remove` for many keys in one call."""
        self._store.batch_remove(keys, True)

    def get_bytes(self, key: str) -> bytes:
        """The object ``key`` whole (b"" when absent)."""
        return bytes(self._store.get(key) or b"")

    def upsert(self, key: str, data: bytes) -> None:
        """Put ``key``, replacing any object of that name."""
        with contextlib.suppress(Exception):
            self._store.remove(key, True)
        rc = self._store.put(key, data)
        if rc != 0:
            raise MooncakeError(f"put {key!r} failed ({rc}): the pool may be full or down")

    def batch_exists(self, keys: list[str]) -> list[bool]:
        """Whether the pool holds each key."""
        if not keys:
            return []
        return [int(x) == 1 for x in self._store.batch_is_exist(keys)]

    def exists(self, key: str) -> bool:
        return bool(self._store.is_exist(key) == 1)

    def remove(self, key: str) -> None:
        """Drop ``key`` now. Every read or existence check takes a lease on the object
        (10 s by default) and a plain remove fails while it lasts; an evicting cache has
        finished its own reads, so it forces. A key the master already evicted is fine."""
        self._store.remove(key, True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for addr in list(self._registered):
            self._store.unregister_buffer(addr)
        self._registered.clear()
        self._store.close()

    def __enter__(self) -> MooncakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
