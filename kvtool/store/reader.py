"""Reading many slots of an :class:`~kvtool.store.objectstore.ObjectStore` back: ``qd``
reads in flight, a check per object on CPU workers (what ``verify`` and ``bench`` use)."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtool.store.io import AlignedBuffer
from kvtool.store.writer import cpu_workers

if TYPE_CHECKING:
    from kvtool.store.objectstore import ObjectStore


def read_slots(store: ObjectStore, slots: list[int], *, qd: int,
               check: Callable[[int, np.ndarray], Any]) -> Iterator[tuple[int, Any]]:
    """Read each slot's padded extent into aligned buffers with ``qd`` reads in flight,
    run ``check(slot, extent)`` on a CPU worker, and yield ``(slot, result)`` in
    completion order (so a slow read never holds the queue depth down).

    ``extent`` is valid only during the call. When the read itself fails, the ``OSError``
    is yielded in place of check's result.
    """
    sb = store.sb
    workers = cpu_workers()
    window = qd + workers
    free: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
    owned = [AlignedBuffer(sb.slot_bytes) for _ in range(window)]
    for b in owned:
        free.put(b)
    done: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()
    cpu = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtool-check")

    def checked(slot: int, buf: AlignedBuffer, read: Future[None]) -> None:
        outcome: tuple[int, Any, BaseException | None]
        try:
            exc = read.exception()
            if isinstance(exc, OSError):
                outcome = (slot, exc, None)
            elif exc is not None:
                outcome = (slot, None, exc)
            else:
                outcome = (slot, check(slot, np.frombuffer(buf.view, dtype=np.uint8)), None)
        except BaseException as err:
            outcome = (slot, None, err)
        free.put(buf)  # before reporting, so the next read finds a buffer at once
        done.put(outcome)

    def start(slot: int) -> None:
        buf = free.get()
        store.engine.submit_read(sb.slot_offset(slot), buf.view).add_done_callback(
            lambda read: cpu.submit(checked, slot, buf, read))

    inflight = 0

    def finish() -> tuple[int, Any]:
        """Take the next completion (any slot); re-raise its error."""
        nonlocal inflight
        s, result, err = done.get()
        inflight -= 1
        if err is not None:
            raise err
        return s, result

    try:
        for slot in slots:
            if inflight >= window:
                yield finish()
            start(slot)
            inflight += 1
        while inflight:
            yield finish()
    finally:
        while inflight:  # draining after an error or an abandoned generator
            done.get()
            inflight -= 1
        cpu.shutdown(wait=True)
        for b in owned:
            b.close()
