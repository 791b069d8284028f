"""The userspace NVMe/TCP target: listeners, the discovery controller, I/O subsystems.

Library use::

    cfg = simple_config(nqn="nqn.2026-01.io.kvtool:t1", backing="64MiB", allow_any_host=True,
                        listen=["127.0.0.1:0"])
    target = Target(cfg).start_in_thread()     # returns once listening
    print(target.urls())                       # ['nvme+tcp://127.0.0.1:40123/nqn...']
    target.stop()                              # closes connections, flushes, closes backings

or ``await Target(cfg).serve()`` inside an event loop (returns after :meth:`request_stop`).
All protocol work runs on one event loop thread; backings are called synchronously there.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from emulator.nvmetcp.auth import load_host_keys
from emulator.nvmetcp.backing import open_backing
from emulator.nvmetcp.config import ANAGRPMAX, EmulatorConfig, parse_listen
from emulator.nvmetcp.connection import QueueConnection
from emulator.nvmetcp.logpages import ERROR_LOG_SLOTS
from emulator.nvmetcp.metrics import TargetMetrics
from emulator.nvmetcp.queue import Queue
from emulator.nvmetcp.subsystem import (
    Controller,
    Namespace,
    Subsystem,
    build_subsystems,
    discovery_subsystem,
)
from emulator.nvmetcp.transport import Listener
from kvtool import __version__
from kvtool.nvme import spec
from kvtool.nvme.dhchap import HostKeys

log = logging.getLogger("emulator.nvmetcp")

VS_1_3 = spec.vs_value(1, 3, 0)
ANATT_S = 10  # ANA transition time (Linux nvmet reports 10 s as well)
MAX_NAMESPACES = 1024  # NN and MNAN, as Linux nvmet (NVMET_MAX_NAMESPACES)


async def _call(fn: Callable[[], None]) -> None:
    fn()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class TargetState:
    """Everything the connections share (event-loop confined)."""

    def __init__(self, config: EmulatorConfig, subsystems: dict[str, Subsystem],
                 loop: asyncio.AbstractEventLoop,
                 host_keys: dict[str, HostKeys] | None = None) -> None:
        self.config = config
        self.host_keys = host_keys or {}  # host NQN → DH-HMAC-CHAP keys
        self.subsystems = subsystems
        self.discovery = discovery_subsystem()
        self.loop = loop
        self.connections: set[Queue] = set()
        self.vs = VS_1_3
        self.max_transfer = (1 << config.mdts) * 4096
        self.genctr = 1
        self.listeners: list[tuple[str, int]] = []
        self.ana: dict[int, dict[int, int]] = config.ana_states()  # listener → {group: state}
        self.ana_chgcnt = 1

    # --- ANA: a state per (listener, group); a namespace belongs to one group ---------------

    def listener_index(self, local: tuple[str, int] | None) -> int | None:
        """Which listener a connection's local address belongs to (a wildcard listener
        matches any address on its port)."""
        if local is None:
            return None
        for i, (host, port) in enumerate(self.listeners):
            if port == local[1] and (host == local[0] or host in ("0.0.0.0", "::")):
                return i
        return None

    def ana_state(self, local: tuple[str, int] | None, grpid: int) -> int:
        if not self.ana:  # every group optimized everywhere (the usual case): no lookup
            return spec.ANA_OPTIMIZED
        index = self.listener_index(local)
        return self.ana.get(index, {}).get(grpid, spec.ANA_OPTIMIZED) if index is not None \
            else spec.ANA_OPTIMIZED

    def ana_log(self, ctrl: Controller, *, rgo: bool) -> bytes:
        """The ANA log page as seen through ``ctrl``'s port: one descriptor per group that
        has namespaces in its subsystem."""
        groups: dict[int, list[int]] = {}
        for nsid, ns in sorted(ctrl.subsys.namespaces.items()):
            groups.setdefault(ns.anagrpid, []).append(nsid)
        descs = [spec.AnaGroup(g, self.ana_state(ctrl.port, g), tuple(nsids), self.ana_chgcnt)
                 for g, nsids in sorted(groups.items())]
        return spec.encode_ana_log(self.ana_chgcnt, descs, rgo=rgo)

    def set_ana(self, states: dict[int, dict[int, int]]) -> list[int]:
        """Replace the ANA states; controllers on a listener whose states changed get the
        ANA Change notice. Returns the changed listeners' indexes."""
        changed = [i for i in range(len(self.listeners))
                   if {g: s for g, s in self.ana.get(i, {}).items() if s != spec.ANA_OPTIMIZED}
                   != {g: s for g, s in states.get(i, {}).items() if s != spec.ANA_OPTIMIZED}]
        self.ana = {i: dict(g) for i, g in states.items()}
        if changed:
            self.ana_chgcnt += 1
            for sub in self.subsystems.values():
                for ctrl in list(sub.controllers.values()):
                    if self.listener_index(ctrl.port) in changed:
                        ctrl.ana_changed()
        return changed

    def find_subsystem(self, nqn: str) -> Subsystem | None:
        if nqn == spec.DISCOVERY_NQN:
            return self.discovery
        return self.subsystems.get(nqn)

    def identify_controller(self, ctrl: Controller) -> bytes:
        sub = ctrl.subsys
        cfg = self.config
        disc = sub.is_discovery
        cmic = spec.CMIC_MULTI_CTRL
        if not disc:
            cmic |= spec.CMIC_ANA | (spec.CMIC_MULTI_PORT if len(self.listeners) > 1 else 0)
        return spec.ControllerInfo(
            vid=0, ssvid=0, sn=sub.serial, mn=sub.model, fr=__version__[:8],
            mdts=cfg.mdts, cntlid=ctrl.cntlid, ver=self.vs,
            cntrltype=2 if disc else 1, kas=10, sqes=0x66, cqes=0x44,
            maxcmd=cfg.max_queue_size, nn=0 if disc else MAX_NAMESPACES,
            oncs=0 if disc else spec.ONCS_DSM | spec.ONCS_WRITE_ZEROES, vwc=0 if disc else 1,
            sgls=(1 << 0) | (1 << 20), subnqn=sub.nqn,
            ioccsz=0 if disc else (64 + cfg.in_capsule_data_size) // 16,
            iorcsz=0 if disc else 1, icdoff=0, msdbd=0 if disc else 1,
            ctratt=spec.CTRATT_HOST_ID_128 | spec.CTRATT_TBKAS,
            oaes=0 if disc else spec.AEN_CFG_NS_ATTR | spec.AEN_CFG_ANA_CHANGE,
            lpa=spec.LPA_EXTENDED if disc else (spec.LPA_PER_NS_SMART | spec.LPA_EFFECTS
                                                | spec.LPA_EXTENDED),
            elpe=0 if disc else ERROR_LOG_SLOTS - 1,
            cmic=cmic, anatt=0 if disc else ANATT_S, anacap=0 if disc else spec.ANACAP_ALL,
            anagrpmax=0 if disc else ANAGRPMAX, nanagrpid=0 if disc else ANAGRPMAX,
            mnan=0 if disc else MAX_NAMESPACES,
        ).encode()

    def discovery_log(self, hostnqn: str, local: tuple[str, int] | None) -> bytes:
        """Entries for the subsystems ``hostnqn`` may use, on the port it connected to."""
        addrs = [local] if local is not None else self.listeners
        entries = []
        for sub in self.subsystems.values():
            if not sub.host_allowed(hostnqn):
                continue
            for host, port in addrs:
                entries.append(spec.DiscoveryEntry(
                    trtype=spec.TRTYPE_TCP,
                    adrfam=spec.ADRFAM_IPV6 if ":" in host else spec.ADRFAM_IPV4,
                    subtype=spec.SUBTYPE_NVME, treq=0x4,  # not specified; SQ flow ctl may be off
                    portid=self.config.port_id, cntlid=0xFFFF, asqsz=32,
                    trsvcid=str(port), subnqn=sub.nqn, traddr=host))
        return spec.encode_discovery_log(self.genctr, entries)


class Target:
    """An NVMe/TCP target serving ``config`` (see the module docstring)."""

    def __init__(self, config: EmulatorConfig, *, metrics: TargetMetrics | None = None) -> None:
        config.validate()
        self.config = config
        self.metrics = metrics
        self.host_keys = load_host_keys(config)  # may raise InputError (mode, format)
        self.subsystems = build_subsystems(config)  # opens the backings; may raise InputError
        self.state: TargetState | None = None
        self.addresses: list[tuple[str, int]] = []
        self._servers: list[Listener | None] = []  # None: closed (set_closed)
        self._stop_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind every listener (port 0 picks a free port; see :attr:`addresses`)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop_event = asyncio.Event()
        state = TargetState(self.config, self.subsystems, loop, self.host_keys)
        self.state = state
        try:
            for addr in self.config.listen:
                host, port = parse_listen(addr)
                conn = self.metrics.connection_class() if self.metrics else QueueConnection
                listener = Listener(loop, host, port, lambda c=conn: c(state))  # type: ignore[misc]
                self._servers.append(listener)
                self.addresses.append((str(listener.address[0]), int(listener.address[1])))
        except OSError:
            await self._shutdown()
            raise
        state.listeners = list(self.addresses)
        log.info("listening on %s", ", ".join(f"{h}:{p}" for h, p in self.addresses))

    async def serve(self) -> None:
        """Start, serve until :meth:`request_stop`, then shut down cleanly."""
        if self._stop_event is None:
            await self.start()
        assert self._stop_event is not None
        await self._stop_event.wait()
        await self._shutdown()

    def request_stop(self) -> None:
        """Ask :meth:`serve` to return (call from the loop thread or a signal handler)."""
        if self._stop_event is not None:
            self._stop_event.set()

    async def _shutdown(self) -> None:
        for server in self._servers:
            if server is not None:
                server.close()
        self._servers.clear()
        if self.state is not None:
            for conn in list(self.state.connections):
                conn.close("target shutting down")
            for _ in range(50):  # let queued responses go out and connection_lost run
                if not self.state.connections:
                    break
                await asyncio.sleep(0.01)
        self.close_backings()

    def close_backings(self) -> None:
        """Flush and close every namespace's backing (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for sub in self.subsystems.values():
            for ns in sub.namespaces.values():
                try:
                    ns.backing.close()
                except OSError as exc:
                    log.error("closing %s: %s", ns.backing.description, exc)

    # --- thread helpers for tests and embedding -------------------------------------------

    def start_in_thread(self, timeout: float = 10.0) -> Target:
        """Run the target on its own event-loop thread; return once it listens."""
        ready = threading.Event()
        errors: list[BaseException] = []

        async def main() -> None:
            try:
                await self.start()
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                self.close_backings()
                return
            ready.set()
            await self.serve()

        def run() -> None:
            asyncio.run(main())

        self._thread = threading.Thread(target=run, name="nvmetcp-target", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("the target did not start listening in time")
        if errors:
            raise errors[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop a target started with :meth:`start_in_thread` and wait for it."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(self.request_stop)
            thread.join(timeout)
        self._thread = None

    def __enter__(self) -> Target:
        return self.start_in_thread()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- namespaces while running -------------------------------------------------------

    def add_namespace(self, subnqn: str, nsid: int, backing: str, *, lba_size: int = 512,
                      timeout: float = 10.0) -> None:
        """Attach a namespace to a running subsystem; connected hosts get the Changed
        Namespace List notice (if they enabled it), as with Linux nvmet's ``enable``."""
        sub = self.subsystems.get(subnqn)
        if sub is None:
            raise ValueError(f"no subsystem {subnqn}")
        if lba_size not in (512, 4096) or not 1 <= nsid < 0xFFFFFFFF:
            raise ValueError("lba_size must be 512 or 4096 and nsid 1..0xFFFFFFFE")
        opened = open_backing(backing, field="backing")
        if opened.size < lba_size:
            opened.close()
            raise ValueError(f"backing {backing} is smaller than one block")
        ns = Namespace(nsid, opened, lba_size, subnqn)

        def attach() -> None:
            if nsid in sub.namespaces:
                opened.close()
                raise ValueError(f"namespace {nsid} already exists on {subnqn}")
            sub.namespaces[nsid] = ns
            sub.namespaces_changed(nsid)

        self._on_loop(attach, timeout)

    def remove_namespace(self, subnqn: str, nsid: int, *, timeout: float = 10.0) -> None:
        """Detach a namespace (its backing is flushed and closed); hosts are notified."""
        sub = self.subsystems.get(subnqn)
        if sub is None:
            raise ValueError(f"no subsystem {subnqn}")

        def detach() -> None:
            ns = sub.namespaces.pop(nsid, None)
            if ns is None:
                raise ValueError(f"no namespace {nsid} on {subnqn}")
            sub.namespaces_changed(nsid)
            ns.backing.close()

        self._on_loop(detach, timeout)

    def resize_namespace(self, subnqn: str, nsid: int, size: int, *,
                         timeout: float = 10.0) -> None:
        """Grow or shrink a namespace (memory or regular file) to ``size`` bytes, a whole
        number of blocks; connected hosts get the Changed Namespace List notice."""
        sub = self.subsystems.get(subnqn)
        if sub is None:
            raise ValueError(f"no subsystem {subnqn}")

        def resize() -> None:
            ns = sub.namespaces.get(nsid)
            if ns is None:
                raise ValueError(f"no namespace {nsid} on {subnqn}")
            if size <= 0 or size % ns.lba_size:
                raise ValueError(f"size must be a positive multiple of {ns.lba_size}")
            ns.backing.resize(size)
            sub.namespaces_changed(nsid)

        self._on_loop(resize, timeout)

    def set_ana(self, states: dict[str, dict[str, str]], *, timeout: float = 10.0) -> None:
        """Replace the ANA states (``EmulatorConfig.ana``'s form: {listen address: {group:
        state}}); hosts connected through a changed listener get the ANA Change notice."""
        from dataclasses import replace
        parsed = replace(self.config, ana=states).ana_states()  # InputError when bad
        self.config.ana = states

        def apply() -> None:
            assert self.state is not None
            self.state.set_ana(parsed)

        self._on_loop(apply, timeout)

    def set_closed(self, addrs: list[str], *, timeout: float = 10.0) -> None:
        """Fault injection: close the listeners at ``addrs`` (listen addresses as in the
        config) and drop every connection through them, as a port whose link went down;
        listeners not named are (re)opened on their address."""
        from dataclasses import replace
        replace(self.config, closed=addrs).validate()  # InputError when one is not a listener
        self.config.closed = list(addrs)
        closed = self.config.closed_indexes()

        def apply() -> None:
            state = self.state
            assert state is not None and self._loop is not None
            for i, (host, port) in enumerate(self.addresses):
                server = self._servers[i] if i < len(self._servers) else None
                if i in closed and server is not None:
                    server.close()
                    self._servers[i] = None
                    for conn in list(state.connections):
                        if state.listener_index(conn.local) == i:
                            conn.close("listener closed (fault injection)")
                elif i not in closed and server is None:
                    conn_class = self.metrics.connection_class() if self.metrics \
                        else QueueConnection
                    self._servers[i] = Listener(self._loop, host, port,
                                                lambda c=conn_class: c(state))  # type: ignore[misc]
            log.info("closed listeners: %s", ", ".join(addrs) or "none")

        self._on_loop(apply, timeout)

    def _on_loop(self, fn: Callable[[], None], timeout: float) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            fn()  # not serving from a thread: the caller is the loop's own thread or none
            return
        fut = asyncio.run_coroutine_threadsafe(_call(fn), loop)
        fut.result(timeout)

    # --- introspection --------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self.addresses[0][1]

    def urls(self) -> list[str]:
        """``nvme+tcp://HOST:PORT/SUBNQN`` for every subsystem on every listener."""
        return [f"nvme+tcp://{_url_host(h)}:{p}/{sub}"
                for h, p in self.addresses for sub in self.subsystems]

    def discovery_url(self) -> str:
        h, p = self.addresses[0]
        return f"nvme+tcp://{_url_host(h)}:{p}/{spec.DISCOVERY_NQN}"
