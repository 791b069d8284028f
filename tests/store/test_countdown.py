"""kvtool.store.io.Countdown and combine: one future for several operations."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from kvtool.store.io import Countdown, combine


def test_resolves_after_the_last_with_the_first_failure() -> None:
    count = Countdown(3)
    first, second = OSError(5, "first"), OSError(28, "second")
    count.settle(first)
    count.settle(second)
    assert not count.fut.done()  # one still out: its buffer is still in use
    count.settle(None)
    assert count.fut.exception() is first


def test_no_operations_is_done_and_many_threads_count_once_each() -> None:
    assert Countdown(0).fut.result(0) is None
    count = Countdown(400)
    threads = [threading.Thread(target=lambda: [count.settle(None) for _ in range(100)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count.fut.result(0) is None


def test_combine_waits_for_every_future() -> None:
    futs: list[Future[None]] = [Future() for _ in range(3)]
    out = combine(futs)
    futs[1].set_exception(ValueError("bad"))
    futs[0].set_result(None)
    assert not out.done()
    futs[2].set_result(None)
    with pytest.raises(ValueError, match="bad"):
        out.result(0)
