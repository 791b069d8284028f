"""Pausing Python's cyclic garbage collector around work that makes no reference cycles.

The cyclic collector runs whenever allocations outnumber deallocations by a threshold, and
each of its passes walks every container object of the generations it collects. A trace
replay keeps hundreds of thousands of lists of block ids alive and frees them by reference
counting alone (they hold no cycle), so those passes find nothing and cost time: on the
Mooncake conversation trace, one pass after the reader's first pass took about 7 ms of a
0.25-s ``replay --simulate`` (BENCHMARKS.md, "Replay speed").
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block and restore its state after it (also
    on an exception). Nested uses are fine: only the outermost re-enables it. Objects
    stay freed by reference counting; only cycles made inside the block wait for the
    next collection after it."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
