"""What command handlers use of a queue and of the target's shared state, as Protocols.

The handlers (:mod:`.commands`, :mod:`.admin`, :mod:`.fabrics`, :mod:`.nvm`, :mod:`.auth`,
:mod:`.sgl`) answer through a :class:`Queue` (the real one is
:class:`~emulator.nvmetcp.connection.QueueConnection`) and read the target's
:class:`Shared` state (the real one is :class:`~emulator.nvmetcp.target.TargetState`).
This module imports neither, so imports run one way: target → connection → handlers →
this leaf.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from emulator.nvmetcp.config import EmulatorConfig
from emulator.nvmetcp.subsystem import Controller, Subsystem
from kvtool.nvme import dhchap


class Shared(Protocol):
    """The state every queue of one target shares (event-loop confined)."""

    config: EmulatorConfig
    host_keys: dict[str, dhchap.HostKeys]  # host NQN → DH-HMAC-CHAP keys
    loop: asyncio.AbstractEventLoop
    connections: set[Queue]
    vs: int  # the Version property
    max_transfer: int  # bytes: MDTS as a byte count
    ana: dict[int, dict[int, int]]  # listener → {group: state}; empty: all optimized

    def find_subsystem(self, nqn: str) -> Subsystem | None: ...

    def ana_state(self, local: tuple[str, int] | None, grpid: int) -> int: ...

    def ana_log(self, ctrl: Controller, *, rgo: bool) -> bytes: ...

    def identify_controller(self, ctrl: Controller) -> bytes: ...

    def discovery_log(self, hostnqn: str, local: tuple[str, int] | None) -> bytes: ...


class Queue(Protocol):
    """One NVMe/TCP queue as a handler sees it. Invariant: every command a handler takes
    is answered exactly once, by :meth:`complete`, :meth:`send_data` (which completes it)
    or :meth:`receive_data` (whose ``finish`` answers it)."""

    state: Shared
    qid: int  # -1 until Fabrics Connect; 0 the admin queue
    ctrl: Controller | None  # the controller, once connected
    auth: dhchap.ControllerAuth | None  # DH-HMAC-CHAP on this queue
    aers: list[int]  # CIDs of outstanding Asynchronous Event Requests
    landed: memoryview | None  # in-capsule write data already in place
    peer: str  # "host:port" of the other end, for logs
    local: tuple[str, int] | None  # the listener address it came in on

    @property
    def connected(self) -> bool: ...

    def bind(self, ctrl: Controller, subsys: Subsystem, qid: int, sqsize: int,
             cattr: int) -> None: ...

    def complete(self, cid: int, st: int = 0, dw0: int = 0, dw1: int = 0) -> None: ...

    def send_data(self, cid: int, data: bytes | memoryview) -> None: ...

    def receive_data(self, cid: int, length: int, dest: memoryview | None,
                     finish: Callable[[memoryview], None]) -> None: ...

    def flush(self) -> None: ...

    def close(self, reason: str) -> None: ...
