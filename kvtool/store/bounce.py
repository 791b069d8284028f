"""Object I/O on top of an :class:`~kvtool.store.io.IOEngine`: zero-copy or bounce.

An object of ``nbytes`` occupies ``padded_size(nbytes, lba)`` bytes on the namespace.

* **zero-copy** — the caller's buffer is aligned to ``mem_align`` and its length is a whole
  number of LBAs: the engine reads/writes it directly.
* **bounce** — otherwise: a write copies the object into an aligned scratch buffer, zeroes
  the pad tail and writes the padded extent; a read fills the scratch with the padded
  extent and copies back only the first ``nbytes`` (the pad never reaches the caller).

:class:`ScratchPool` hands out page-aligned scratch buffers so a pipeline with ``qd``
requests in flight never allocates per object.
"""

from __future__ import annotations

import ctypes
import queue
from concurrent.futures import Future
from typing import Literal

import numpy as np

from kvtool.align import padded_size
from kvtool.store.io import AlignedBuffer, IOEngine
from kvtool.store.io import buffer_address as address

Path = Literal["zero-copy", "bounce"]


def as_bytes_view(data: bytes | memoryview | np.ndarray) -> memoryview:
    """A 1-D unsigned-byte view of ``data`` (no copy)."""
    view = memoryview(data)  # type: ignore[arg-type,unused-ignore]
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def io_path(buf: memoryview, lba: int, mem_align: int) -> Path:
    """Which path an object held in ``buf`` takes."""
    if buf.nbytes % lba == 0 and address(buf) % mem_align == 0:
        return "zero-copy"
    return "bounce"


class ScratchPool:
    """A fixed set of aligned buffers of ``nbytes`` each; ``get`` blocks when all are out."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._all = [AlignedBuffer(nbytes) for _ in range(count)]
        self._free: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        for b in self._all:
            self._free.put(b)

    def get(self) -> AlignedBuffer:
        return self._free.get()

    def put(self, buf: AlignedBuffer) -> None:
        self._free.put(buf)

    def close(self) -> None:
        for b in self._all:
            b.close()
        self._all = []


def copy_into(dst: memoryview, src: memoryview) -> None:
    """``dst[:len(src)] = src`` without Python-level slicing overhead (memmove)."""
    n = src.nbytes
    if n:
        ctypes.memmove(address(dst), address(src), n)


def stage_for_write(data: memoryview, scratch: AlignedBuffer, padded: int) -> memoryview:
    """Copy ``data`` into ``scratch`` and zero its pad: the padded view to write."""
    n = data.nbytes
    copy_into(scratch.view, data)
    if padded > n:
        ctypes.memset(address(scratch.view) + n, 0, padded - n)
    return scratch.view[:padded]


def write_object(engine: IOEngine, offset: int, data: memoryview,
                 scratch: AlignedBuffer | None = None) -> Future[None]:
    """Submit a write of one object at ``offset`` (LBA-aligned); bounce when needed.

    With the bounce path ``scratch`` (at least the padded size) must stay untouched until
    the returned future is done.
    """
    data = data.cast("B") if data.format != "B" else data
    padded = padded_size(data.nbytes, engine.lba_size)
    if io_path(data, engine.lba_size, engine.mem_align) == "zero-copy":
        return engine.submit_write(offset, data)
    if scratch is None or scratch.nbytes < padded:
        raise ValueError(f"the bounce path needs a scratch buffer of {padded} bytes")
    return engine.submit_write(offset, stage_for_write(data, scratch, padded))


def read_object(engine: IOEngine, offset: int, nbytes: int, out: memoryview,
                scratch: AlignedBuffer | None = None) -> None:
    """Read one ``nbytes`` object at ``offset`` into ``out[:nbytes]`` (blocking)."""
    padded = padded_size(nbytes, engine.lba_size)
    target = out[:nbytes]
    if io_path(target, engine.lba_size, engine.mem_align) == "zero-copy":
        engine.read_into(offset, target)
        return
    if scratch is None or scratch.nbytes < padded:
        raise ValueError(f"the bounce path needs a scratch buffer of {padded} bytes")
    engine.read_into(offset, scratch.view[:padded])
    copy_into(target, scratch.view[:nbytes])
