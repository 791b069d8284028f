"""Run one SPDK application (``nvmf_tgt`` or ``spdk_tgt``) without hugepages, and stop it.

``SpdkApp(install).start()`` runs ``nvmf_tgt --no-huge -s MEM -m CPUMASK --no-pci -r SOCK``
(``-A BDF`` for each of ``pci_allowed`` instead of ``--no-pci``: PCIe NVMe controllers bound
to vfio-pci, :mod:`kvtool.target.spdk.pci`)
with its own RPC socket in a private directory, optionally loading a ``--json`` config, and
returns once the application has finished initializing (``framework_wait_init``). ``rpc()``
calls any JSON-RPC method; ``stop()`` asks for ``spdk_kill_instance SIGTERM`` and escalates
to SIGTERM/SIGKILL of its process group, so nothing is left running.

The reactor busy-polls every core in its mask: give the target one core (``0x1``) and SPDK
host tools another (``-c 0x2``) on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtool.target.plan import TargetError
from kvtool.target.spdk.install import SpdkInstall
from kvtool.target.spdk.install import die_with_parent as _die_with_parent
from kvtool.target.spdk.rpc import RpcUnreachable, SpdkRpc

# an application's name for its shared memory (``opts.name`` in SPDK's app/*/ sources)
APP_NAMES = {"nvmf_tgt": "nvmf", "iscsi_tgt": "iscsi", "vhost": "vhost"}


def trace_file(binary: str, pid: int) -> str:
    """The trace buffer an SPDK application ``binary`` started as ``pid`` keeps in shared
    memory (made at start when no shm id is given). The application removes it when it
    exits cleanly; after a SIGKILL or a crash it stays behind, so whoever stops the process
    or finds it gone removes it (:meth:`SpdkApp.stop`; a background target's process
    record lists it among its leftovers)."""
    return f"/dev/shm/{APP_NAMES.get(binary, binary)}_trace.pid{pid}"


class SpdkAppError(RuntimeError):
    """The application did not start or answer; the message carries its log's last lines."""


class SpdkApp:
    """One SPDK application process with a private RPC socket."""

    def __init__(self, install: SpdkInstall, binary: str = "nvmf_tgt", *, cpumask: str = "0x1",
                 mem_mb: int = 1024, config: Path | None = None,
                 workdir: Path | None = None, args: tuple[str, ...] = (),
                 die_with_parent: bool = False, env: dict[str, str] | None = None,
                 pci_allowed: tuple[str, ...] = (), socket: Path | None = None) -> None:
        self.install = install
        self.binary = binary
        self.cpumask = cpumask
        self.mem_mb = mem_mb
        self.config = config
        self.args = args
        self.die_with_parent = die_with_parent  # tests: yes; `kvtool target up`: it outlives us
        self.extra_env = dict(env or {})  # added to the install's environment
        self._own_dir = workdir is None
        self.workdir = workdir if workdir is not None else Path(
            tempfile.mkdtemp(prefix=f"kvtool-{binary}-"))
        # PCI devices SPDK may drive (-A each); none: --no-pci
        self.pci_allowed = tuple(pci_allowed)
        self.socket = socket if socket is not None else self.workdir / "spdk.sock"
        self.log_path = self.workdir / f"{binary}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._rpc: SpdkRpc | None = None
        self._log_kept = ""  # the log, once stop() has removed the private directory

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        pci = [a for bdf in self.pci_allowed for a in ("-A", bdf)] or ["--no-pci"]
        cmd = [str(self.install.bin(self.binary)), "--no-huge", "-s", str(self.mem_mb),
               "-m", self.cpumask, *pci, "-r", str(self.socket),
               # several SPDK apps (other test runs) may share a core on a small machine
               "--disable-cpumask-locks"]
        if self.config is not None:
            cmd += ["--json", str(self.config)]
        return [*cmd, *self.args]

    def start(self, timeout: float = 60.0,
              on_spawn: Callable[[int], None] | None = None) -> SpdkApp:
        """Start and wait until initialized; ``on_spawn(pid)`` runs as soon as the process
        exists (before the wait), e.g. to record it."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.socket.is_socket():  # a killed application's, when nobody listens there
            import socket as sk
            with sk.socket(sk.AF_UNIX) as probe:
                try:
                    probe.connect(str(self.socket))
                except ConnectionRefusedError:
                    self.socket.unlink()
                else:
                    raise SpdkAppError(f"another SPDK application serves {self.socket}")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL,
                                         env={**self.install.env(), **self.extra_env},
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent if self.die_with_parent
                                         else None)
        try:
            if on_spawn is not None:
                on_spawn(self.proc.pid)
            self._wait_ready(timeout)
        except BaseException:  # a failed start, no RPC client, an interrupt: stop the reactor
            tail = self.log_tail()
            self.stop()
            self._log_kept = self._log_kept or tail
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise SpdkAppError(f"{self.binary} exited {self.proc.returncode} at start: "
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise SpdkAppError(f"{self.binary} did not open {self.socket} in {timeout:.0f} s")
            time.sleep(0.05)
        while True:
            try:
                self.rpc("framework_wait_init")
                return
            except RpcUnreachable:
                # the socket is bound but not listening yet (on a slow machine, e.g. a TCG
                # guest, the gap is long enough to connect into): try again while it starts
                if self.proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                exc_text = "its RPC socket never accepted a connection"
            except (TargetError, OSError) as exc:
                exc_text = str(exc)
            raise SpdkAppError(f"{self.binary} did not finish initializing: {exc_text}; "
                               f"{self.log_tail()}") from None

    def rpc(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """Call a JSON-RPC method; SPDK's errors raise ``SpdkError`` (a ``TargetError``)."""
        if self._rpc is None:
            self._rpc = SpdkRpc(str(self.socket), timeout=60.0)
        return self._rpc.call(method, params)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return self._log_kept

    def log_tail(self, lines: int = 5) -> str:
        return " | ".join(self.log_text().strip().splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop the application (idempotent); returns its exit status."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            asked = False
            with contextlib.suppress(Exception):
                self.rpc("spdk_kill_instance", {"sig_name": "SIGTERM"})
                asked = True
            steps = ((None, timeout),) if asked else ()  # else no use waiting for it
            for sig, wait in (*steps, (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(wait)
                    break
        if self._rpc is not None:
            self._rpc.close()
            self._rpc = None
        if proc is not None and proc.poll() is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(trace_file(self.binary, proc.pid))
        if self._own_dir and not os.environ.get("KVTOOL_SPDK_KEEP"):
            self._log_kept = self.log_text()
            shutil.rmtree(self.workdir, ignore_errors=True)
        return proc.returncode if proc is not None else None

    def __enter__(self) -> SpdkApp:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
