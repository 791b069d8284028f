"""The target process's event loop: BusyPollSelector polls after activity, then sleeps."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time

import pytest

from emulator.nvmetcp.transport import BusyPollSelector, new_event_loop


def test_event_arriving_while_polling_is_returned() -> None:
    a, b = socket.socketpair()
    with a, b:
        sel = BusyPollSelector(0.2)
        sel.register(a, selectors.EVENT_READ, "a")
        timer = threading.Timer(0.01, b.send, args=(b"x",))
        timer.start()
        ready = sel.select(5.0)
        timer.join()
        assert [(key.data, ev) for key, ev in ready] == [("a", selectors.EVENT_READ)]
        assert sel.select(0) == [(sel.get_key(a), selectors.EVENT_READ)]  # still unread
        a.recv(1)
        assert sel.select(0) == [] and sel.select(0.02) == []
        sel.close()


@pytest.mark.parametrize("busy_poll", [0.0, 0.0005, 0.05])
def test_loop_serves_sockets_and_timers(busy_poll: float) -> None:
    """Readers and call_later timers fire on a busy-polling loop as on a plain one."""
    loop = new_event_loop(busy_poll)
    assert isinstance(loop._selector, BusyPollSelector) == (busy_poll > 0)  # type: ignore[attr-defined]
    a, b = socket.socketpair()
    got: list[str] = []
    try:
        done = loop.create_future()
        loop.add_reader(a.fileno(), lambda: got.append(a.recv(16).decode()))
        loop.call_later(0.03, b.send, b"ping")
        loop.call_later(0.06, lambda: got.append("timer"))
        loop.call_later(0.09, done.set_result, None)
        loop.run_until_complete(done)
    finally:
        loop.remove_reader(a.fileno())
        loop.close()
        a.close()
        b.close()
    assert got == ["ping", "timer"]


def test_idle_loop_sleeps_after_polling() -> None:
    """Polling is bounded: a loop with nothing to do spends about busy_poll of CPU per
    wait, not the whole wait (an unbounded spin would burn the 0.3 s)."""
    loop = new_event_loop(0.0005)
    try:
        cpu = time.thread_time()
        loop.run_until_complete(asyncio.sleep(0.3))
        used = time.thread_time() - cpu
    finally:
        loop.close()
    assert used < 0.1, used
