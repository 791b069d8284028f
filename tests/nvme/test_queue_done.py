"""kvtool.nvme.queue.Done: the completion flag every command carries (Event semantics)."""

from __future__ import annotations

import threading
import time

from kvtool.nvme.queue import Done


def test_wait_times_out_until_set_then_returns_at_once() -> None:
    done = Done()
    assert not done.is_set()
    assert done.wait(0) is False
    assert done.wait(-1) is False
    t0 = time.monotonic()
    assert done.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04
    done.set()
    assert done.is_set() and done.wait(0) and done.wait() and done.wait(5)
    done.set()  # a second set changes nothing
    assert done.wait(0)


def test_every_waiter_is_released_by_one_set() -> None:
    done = Done()
    woke: list[bool] = []
    threads = [threading.Thread(target=lambda: woke.append(done.wait(10))) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert woke == []
    done.set()
    for t in threads:
        t.join(10)
    assert woke == [True] * 8
