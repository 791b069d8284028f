"""A zero-copy socket transport and listener for the target's event loop.

Why not asyncio's own: on Python 3.11 ``_SelectorSocketTransport.write`` copies whatever
the kernel does not take at once into a ``bytearray`` and later deletes sent bytes from
its front (a memmove each time) — for 1 MiB C2HData PDUs that was most of the target's
CPU time (profiled with py-spy; see docs/nvme-tcp.md). This transport queues the
caller's buffers as memoryviews and sends them with ``sendmsg`` straight from there.

Contract with the protocol (an :class:`asyncio.BufferedProtocol`): ``get_buffer`` /
``buffer_updated`` for received bytes (``recv_into`` fills the protocol's buffer, so a
streamed write lands in its destination without a copy), ``connection_made`` and
``connection_lost``. Buffers passed to :meth:`write` must stay unchanged until sent.
Backpressure: while more than ``PAUSE_READING_AT`` bytes wait to be sent the transport
stops reading, so a host that does not read cannot make the target buffer without bound.

:func:`new_event_loop` makes the loop the target process runs on; with ``busy_poll`` it
polls for events that long before it sleeps (:class:`BusyPollSelector`).
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("emulator.nvmetcp")

PAUSE_READING_AT = 16 << 20
RESUME_READING_AT = 4 << 20
_SENDMSG_MAX_PARTS = 64


class ZeroCopyTransport(asyncio.Transport):
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 protocol: asyncio.BufferedProtocol) -> None:
        super().__init__()
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._out: deque[memoryview] = deque()
        self._out_bytes = 0
        self._closing = False
        self._closed = False
        self._reading = False
        self._writing = False
        self._extra = {"peername": _safe(sock.getpeername), "sockname": _safe(sock.getsockname),
                       "socket": sock}
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        protocol.connection_made(self)
        if not self._closing:
            self._start_reading()

    # --- asyncio.Transport API ----------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def write(self, data: Any) -> None:
        if self._closing:
            return
        view = memoryview(data)
        if not view.nbytes:
            return
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if not self._out:
            try:
                n = self._sock.send(view)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self._fail(exc)
                return
            if n == len(view):
                return
            view = view[n:]
        self._out.append(view)
        self._out_bytes += len(view)
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._on_writable)
        if self._out_bytes > PAUSE_READING_AT:
            self._stop_reading()

    def close(self) -> None:
        """Send what is queued, then close (the protocol's connection_lost follows)."""
        if self._closing:
            return
        self._closing = True
        self._stop_reading()
        if not self._out:
            self._finalize(None)

    def abort(self) -> None:
        self._closing = True
        self._out.clear()
        self._finalize(None)

    # --- event handlers -----------------------------------------------------------------

    def _start_reading(self) -> None:
        if not self._reading and not self._closing:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _on_readable(self) -> None:
        if self._closing:
            return
        try:
            buf = self._protocol.get_buffer(-1)
            n = self._sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        if n == 0:  # the peer closed its side
            self._closing = True
            self._stop_reading()
            self._out.clear()
            self._finalize(None)
            return
        self._protocol.buffer_updated(n)

    def _on_writable(self) -> None:
        out = self._out
        try:
            parts = [out[i] for i in range(min(len(out), _SENDMSG_MAX_PARTS))]
            n = self._sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        self._out_bytes -= n
        while n:
            head = out[0]
            if n >= len(head):
                n -= len(head)
                out.popleft()
            else:
                out[0] = head[n:]
                n = 0
        if not out:
            self._writing = False
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._finalize(None)
                return
        if self._out_bytes < RESUME_READING_AT:
            self._start_reading()

    def _fail(self, exc: BaseException) -> None:
        log.debug("socket error on %s: %s", self._extra.get("peername"), exc)
        self._closing = True
        self._out.clear()
        self._finalize(exc if isinstance(exc, Exception) else None)

    def _finalize(self, exc: Exception | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_reading()
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        self._out.clear()
        self._sock.close()
        self._loop.call_soon(self._protocol.connection_lost, exc)


class Listener:
    """A listening TCP socket whose connections get a protocol and a ZeroCopyTransport."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int,
                 factory: Callable[[], asyncio.BufferedProtocol]) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._loop = loop
        self._sock = sock
        self._factory = factory
        self.address = sock.getsockname()[:2]
        loop.add_reader(sock.fileno(), self._on_accept)

    def _on_accept(self) -> None:
        for _ in range(32):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: keep serving the others
                log.warning("accept failed: %s", exc)
                return
            try:
                ZeroCopyTransport(self._loop, conn, self._factory())
            except OSError as exc:
                log.warning("new connection failed: %s", exc)
                conn.close()

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except OSError:
        return None


class BusyPollSelector(selectors.EpollSelector):
    """An epoll selector that keeps polling for ``busy_poll`` seconds before it sleeps.

    Why: on a small VM a process woken from ``epoll_wait`` starts running tens of
    microseconds after the event; at queue depth 1 a host's next command usually arrives
    within a few hundred microseconds of the last completion, so polling through that gap
    saves one wake-up per command (+17 % 1 MiB reads and +42 % 4 KiB reads at QD 1,
    BENCHMARKS.md). SPDK's target polls all the time; this polls only right after
    activity — an idle target sleeps after ``busy_poll`` and costs nothing. Events are
    never delayed: each poll is ``epoll_wait`` with a zero timeout.
    """

    def __init__(self, busy_poll: float) -> None:
        super().__init__()
        self.busy_poll = busy_poll

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.busy_poll <= 0 or (timeout is not None and timeout <= 0):
            return super().select(timeout)
        spin = self.busy_poll if timeout is None else min(self.busy_poll, timeout)
        end = time.monotonic() + spin
        while True:
            ready = super().select(0)
            if ready or time.monotonic() >= end:
                break
        if ready or timeout == spin:
            return ready
        return super().select(None if timeout is None else timeout - spin)


def new_event_loop(busy_poll: float = 0.0) -> asyncio.AbstractEventLoop:
    """The target process's event loop; ``busy_poll`` > 0: a :class:`BusyPollSelector`."""
    if busy_poll > 0:
        return asyncio.SelectorEventLoop(BusyPollSelector(busy_poll))
    return asyncio.new_event_loop()
