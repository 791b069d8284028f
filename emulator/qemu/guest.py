"""One QEMU (TCG) guest running the real Linux kernel, reached over host loopback.

Invariants:

* The guest's user-mode network runs with ``restrict=on``: it reaches nothing but the
  explicit forwards. Host -> guest: ``hostfwd`` rules bound to 127.0.0.1 only
  (``Guest.host_port(guest_port)``). Guest -> host: for each port in ``guest_forwards``, the
  guest connects to ``10.0.2.100:PORT`` (``GUESTFWD_ADDR``) and a per-connection relay
  (``relay.py``) joins it to host ``127.0.0.1:PORT``.
* ``Guest.exec`` runs a shell snippet as root in the guest over the control channel (guest
  port 2323, always forwarded to a free loopback port). It is unauthenticated and meant for
  tests only; it listens on host loopback and nowhere else.
* With ``target=True`` the guest's /init configures an nvmet-tcp target (subsystem ``nqn``,
  namespace 1 on a brd RAM disk, a tmpfs file or a loop device, port 1 on 0.0.0.0:4420) before it reports
  ready; with ``target=False`` it loads the modules and mounts configfs, and configures
  nothing.
* ``wait_ready`` returns only when the guest is really serving: the console marker is
  seen, the control shell answers and (with a target) an ICResp comes back from the host
  side. slirp accepts connections before the guest listens, so a bare connect proves nothing.
* QEMU dies with the process that started it (PR_SET_PDEATHSIG), so a crashed test run
  leaves no guest eating one of the two CPUs. (Linux sends that signal when the *thread*
  that started QEMU exits: start guests from a thread that outlives them.)

Adapted from the qemu-nvmet recipe (../shared/reference/qemu-nvmet/run-guest.sh,
guest_exec.py; kvtool project).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from emulator.qemu import probe
from emulator.qemu.build import GuestImage, ensure_built, ensure_qemu

DEFAULT_NQN = "nqn.2024-01.io.kvtool:emu"
TARGET_PORT = 4420
CONTROL_PORT = 2323
GUESTFWD_ADDR = "10.0.2.100"
GUEST_ADDR = "10.0.2.15"
READY_MARK = "KVTOOL-GUEST-READY"
TARGET_MARK = "KVTOOL-TARGET-READY"
FAILED_MARK = "KVTOOL-GUEST-FAILED"
_RC_MARK = "__KVT_RC__="
NVME_SLOT0 = 0x10  # PCI slot of the first NVMe controller on pcie.0 (0000:00:10.0)
NVME_MAX = 8
RELAY = Path(__file__).resolve().parent / "relay.py"


class GuestError(RuntimeError):
    """The guest failed to start, died, or did not answer; the message carries the console tail."""


class GuestDied(GuestError, ConnectionError):
    """The control shell did not answer because QEMU is gone: the message says how it ended
    (status -9: killed, as the OOM killer does) and carries the console tail. A
    ConnectionError, as a control shell that does not answer is."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (QEMU binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child


def _die_with_parent() -> None:
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _death_signal_prefix() -> list[str]:
    """util-linux ``setpriv --pdeathsig`` sets the death signal without a preexec_fn (which is
    not safe in a process with threads); the fallback is a preexec_fn."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def guest_exec(control_port: int, shell: str, timeout: float = 60.0,
               host: str = "127.0.0.1") -> tuple[int, str]:
    """Run ``shell`` in a guest through its control port; see ``Guest.exec``.

    For a guest started by another process (``python -m emulator.qemu run`` prints the port).
    """
    # a subshell, so that an `exit` in the snippet still reports its status
    script = f"( {shell}\n) 2>&1; echo {_RC_MARK}$?\nexit\n"
    with socket.create_connection((host, control_port), timeout=timeout) as s:
        s.sendall(script.encode())
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    out = b"".join(chunks).decode(errors="replace")
    if _RC_MARK not in out:
        raise ConnectionError(f"no reply from the guest control shell (got {out[-200:]!r})")
    body, _, rc = out.rpartition(_RC_MARK)
    return int(rc.strip() or 255), body


class Guest:
    """A Linux guest under QEMU TCG. Use as a context manager, or ``start()`` / ``stop()``.

    Parameters:
      image: a built ``GuestImage`` (default: ``ensure_built()``).
      target: boot with the auto-configured nvmet-tcp target (True) or none (False).
      nqn, size_mb, backing ("ram" | "file" | "loop"), allowed_hosts: the target's subsystem
        NQN, namespace 1 size and backing (brd, a tmpfs file, or a loop device over one: the
        only one whose SMART log counts Data Units Written), and allowed host NQNs (empty:
        allow any host).
        ``size_mb`` also sizes /dev/ram0 when ``target`` is False.
      forwards: extra host -> guest forwards, ``{guest_port: host_port}``; host_port 0 picks a
        free one. Guest port 4420 and the control port are always forwarded.
      guest_forwards: host loopback ports the guest may reach, at ``GUESTFWD_ADDR:PORT``.
      hostroot: share the host's / read-only over 9p; /init mounts it with a tmpfs overlay at
        /hostroot (proc, sys, dev, tmp and configfs bound inside) for ``chroot /hostroot``.
      mem_mb: guest RAM. boot_timeout: seconds ``wait_ready`` waits. smp: virtual CPUs.
      nvme: raw image files, one QEMU PCIe NVMe controller each (``-device nvme``), at PCI
        addresses ``nvme_bdf(i)`` (serial ``KVTNVME<i>``); /init loads the kernel's nvme driver
        and vfio-pci. Writes reach the file (QEMU honours Flush), so it is durable backing.
      iommu: an emulated Intel IOMMU with interrupt remapping (``-device intel-iommu``; guest
        ``intel_iommu=on iommu=pt``), so vfio-pci can map DMA for SPDK's userspace driver
        without hugepages (vfio refuses an IOMMU without interrupt remapping).
      cpu: QEMU's ``-cpu`` (default ``qemu64,+rdrand``); ``max`` gives the guest every
        instruction TCG emulates (SSE4.2, POPCNT, AVX2), which the host's numpy and SPDK
        (built for x86-64-v2) need when run in the guest through ``hostroot``.
      rdma: /init loads soft-RoCE (rdma_rxe), rdma_ucm, nvme-rdma and nvmet-rdma; an rxe
        device is made on eth0 with ``rdma link add`` (emulator.qemu.rdma).
    """

    def __init__(
        self,
        image: GuestImage | None = None,
        *,
        target: bool = True,
        nqn: str = DEFAULT_NQN,
        size_mb: int = 64,
        backing: str = "ram",
        allowed_hosts: Sequence[str] = (),
        forwards: Mapping[int, int] | None = None,
        guest_forwards: Sequence[int] = (),
        hostroot: bool = False,
        mem_mb: int = 256,
        boot_timeout: float = 180.0,
        extra_cmdline: Sequence[str] = (),
        nvme: Sequence[str | Path] = (),
        iommu: bool = False,
        rdma: bool = False,
        smp: int = 1,
        cpu: str = "qemu64,+rdrand",
    ) -> None:
        if backing not in ("ram", "file", "loop"):
            raise ValueError(f"backing must be 'ram', 'file' or 'loop', not {backing!r}")
        if size_mb <= 0:
            raise ValueError("size_mb must be positive")
        if not 1 <= smp <= 8:
            raise ValueError("smp must be 1..8")
        if len(nvme) > NVME_MAX:
            raise ValueError(f"at most {NVME_MAX} NVMe controllers")
        for text in (nqn, *allowed_hosts):
            if not text or any(c.isspace() or c == "," for c in text):
                raise ValueError(f"NQN must be non-empty without spaces or commas: {text!r}")
        self.image = image
        self.target = target
        self.nqn = nqn
        self.size_mb = size_mb
        self.backing = backing
        self.allowed_hosts = tuple(allowed_hosts)
        self.guest_forwards = tuple(guest_forwards)
        self.hostroot = hostroot
        self.mem_mb = mem_mb
        self.boot_timeout = boot_timeout
        self.extra_cmdline = tuple(extra_cmdline)
        self.nvme = tuple(Path(p) for p in nvme)
        self.iommu = iommu
        self.rdma = rdma
        self.smp = smp
        self.cpu = cpu
        self._requested = {TARGET_PORT: 0, CONTROL_PORT: 0, **(forwards or {})}
        self._ports: dict[int, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._rundir: Path | None = None
        self._last_log = ""
        self._t0 = 0.0
        self.boot_seconds: float | None = None
        """Seconds from QEMU launch to ready (set by ``wait_ready``)."""

    # --- addresses ---------------------------------------------------------------------------
    def host_port(self, guest_port: int) -> int:
        """The 127.0.0.1 port forwarded to ``guest_port``."""
        try:
            return self._ports[guest_port]
        except KeyError:
            raise KeyError(f"guest port {guest_port} is not forwarded (forwards=...)") from None

    @property
    def target_port(self) -> int:
        """Host loopback port of the guest's NVMe/TCP port 4420."""
        return self.host_port(TARGET_PORT)

    @property
    def control_port(self) -> int:
        return self.host_port(CONTROL_PORT)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def console_path(self) -> Path | None:
        return self._rundir / "console.log" if self._rundir else None

    @property
    def console_log(self) -> str:
        """Everything the guest printed on its serial console so far (kept after ``stop``)."""
        path = self.console_path
        if path is not None and path.exists():
            self._last_log = path.read_bytes().decode(errors="replace")
        return self._last_log

    @staticmethod
    def nvme_bdf(index: int) -> str:
        """The guest's PCI address of NVMe controller ``index`` (``nvme=[...]``)."""
        return f"0000:00:{NVME_SLOT0 + index:02x}.0"

    def cmdline(self) -> str:
        """The kernel command line this guest boots with."""
        args = ["console=ttyS0", "panic=-1", "quiet", "loglevel=4",
                f"kvt.target={int(self.target)}", f"kvt.nqn={self.nqn}", f"kvt.port={TARGET_PORT}",
                f"kvt.size_mb={self.size_mb}", f"kvt.backing={self.backing}",
                f"kvt.hostroot={int(self.hostroot)}"]
        if self.rdma:
            args.append("kvt.rdma=1")
        if self.nvme:
            args.append("kvt.pcie=1")
        if self.iommu:
            # no_timer_check: under TCG on a busy machine the kernel's check that the timer
            # interrupt arrives through the remapped IO-APIC can time out (a panic at boot)
            args += ["intel_iommu=on", "iommu=pt", "no_timer_check"]
        if self.allowed_hosts:
            args.append("kvt.hosts=" + ",".join(self.allowed_hosts))
        return " ".join([*args, *self.extra_cmdline])

    def qemu_argv(self) -> list[str]:
        """The QEMU command line (ports must have been assigned)."""
        assert self.image is not None and self._rundir is not None
        net = ["user", "id=n0", "restrict=on"]
        for guest_port, host_port in sorted(self._ports.items()):
            net.append(f"hostfwd=tcp:127.0.0.1:{host_port}-:{guest_port}")
        for port in self.guest_forwards:
            relay = " ".join(shlex.quote(a) for a in (sys.executable, "-I", str(RELAY), str(port)))
            net.append(f"guestfwd=tcp:{GUESTFWD_ADDR}:{port}-cmd:{relay}")
        # QEMU's option syntax: a literal comma inside a value is written twice
        netdev = ",".join(part.replace(",", ",,") if "cmd:" in part else part for part in net)
        argv = [
            # +rdrand: TCG emulates it, and the guest's CRNG is ready at once (6.12's
            # nvme gen-dhchap-key would otherwise fail on getrandom(GRND_NONBLOCK))
            "qemu-system-x86_64", "-accel", "tcg,thread=multi,tb-size=64", "-cpu", self.cpu,
            "-m", str(self.mem_mb), "-smp", str(self.smp), "-machine", "q35", "-nodefaults", "-no-reboot",
            "-display", "none", "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd),
            "-append", self.cmdline(), "-serial", f"file:{self._rundir / 'console.log'}",
            "-netdev", netdev, "-device", "virtio-net-pci,netdev=n0",
        ]
        # the IOMMU goes before the devices it translates for; 48-bit addresses, since SPDK maps
        # DMA by virtual address (IOVA = VA from 0x200000000000: over the default 39 bits)
        if self.iommu:
            argv[argv.index("-netdev"):argv.index("-netdev")] = [
                "-device", "intel-iommu,intremap=on,aw-bits=48"]
        for i, path in enumerate(self.nvme):
            argv += ["-drive", f"file={path},if=none,id=nvm{i},format=raw",
                     "-device", f"nvme,serial=KVTNVME{i},drive=nvm{i},bus=pcie.0,"
                                f"addr={NVME_SLOT0 + i:#x}"]
        if self.hostroot:
            # multidevs=remap: the host's /proc, /sys, /dev … are other file systems whose
            # inode numbers collide with /'s; without the remap the guest's 9p client takes
            # /hostroot/sys and /hostroot/proc for the same directory (sysfs then hides procfs
            # in the chroot, and /proc/PID is missing there)
            argv += ["-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                                "multidevs=remap"]
        return argv

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, *, wait: bool = True) -> Guest:
        """Launch QEMU (building the image first if needed); with ``wait``, also ``wait_ready``."""
        if self._proc is not None:
            raise GuestError("guest already started")
        ensure_qemu()
        if self.image is None:
            self.image = ensure_built()
        self._rundir = Path(tempfile.mkdtemp(prefix="kvtool-qemu-"))
        for attempt in range(3):
            self._ports = {g: (h or free_port()) for g, h in self._requested.items()}
            (self._rundir / "console.log").write_bytes(b"")
            stderr = (self._rundir / "qemu.stderr").open("wb")
            self._t0 = time.monotonic()
            prefix = _death_signal_prefix()
            self._proc = subprocess.Popen(
                prefix + self.qemu_argv(), stdin=subprocess.DEVNULL, stdout=stderr,
                stderr=stderr, preexec_fn=None if prefix else _die_with_parent,
                start_new_session=True,
            )
            stderr.close()
            # a port taken between free_port() and QEMU's bind fails within a moment: retry
            time.sleep(0.3)
            if self._proc.poll() is None:
                break
            err = self._stderr()
            self._proc = None
            if "host forwarding" not in err or attempt == 2:
                self.stop()
                raise GuestError(f"qemu exited at start-up: {err.strip()}")
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()
                raise
        return self

    def _stderr(self) -> str:
        path = self._rundir / "qemu.stderr" if self._rundir else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def _fail(self, why: str) -> GuestError:
        tail = "\n".join(self.console_log.splitlines()[-25:])
        return GuestError(f"{why}\n--- qemu stderr ---\n{self._stderr()}--- console tail ---\n{tail}")

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until the guest serves (see the module invariants); returns seconds since launch."""
        if self._proc is None:
            raise GuestError("guest not started")
        deadline = time.monotonic() + (self.boot_timeout if timeout is None else timeout)
        while True:
            log = self.console_log
            if FAILED_MARK in log:
                raise self._fail("guest /init failed")
            if READY_MARK in log:
                break
            if self._proc.poll() is not None:
                raise self._fail(f"qemu exited with status {self._proc.returncode} during boot")
            if time.monotonic() > deadline:
                raise self._fail(f"no {READY_MARK} on the console within the boot timeout")
            time.sleep(0.05)
        while True:
            try:
                rc, _ = self.exec("true", timeout=5)
                if rc == 0:
                    break
            except (OSError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise self._fail("the guest's control shell does not answer")
            time.sleep(0.1)
        if self.target:
            try:
                probe.wait_for_icresp("127.0.0.1", self.target_port,
                                      max(1.0, deadline - time.monotonic()))
            except (OSError, ValueError) as e:
                raise self._fail(f"no ICResp from the guest's nvmet-tcp target: {e!r}") from e
        self.boot_seconds = time.monotonic() - self._t0
        return self.boot_seconds

    def exec(self, shell: str, timeout: float = 60.0) -> tuple[int, str]:
        """Run ``shell`` as root in the guest (busybox sh); returns (exit status, stdout+stderr).

        Raises TimeoutError when it runs longer than ``timeout`` seconds and ConnectionError
        when the control shell does not answer (:class:`GuestDied` when QEMU has exited).
        """
        try:
            return guest_exec(self.control_port, shell, timeout)
        except OSError as exc:  # (ConnectionError and TimeoutError are OSErrors)
            status = self._proc.poll() if self._proc is not None else None
            if status is None:
                raise
            how = " (killed: SIGKILL, as the OOM killer does)" if status == -9 else ""
            raise GuestDied(str(self._fail(f"qemu exited with status {status}{how} before "
                                           f"the guest answered {shell[:80]!r} ({exc})"))
                            ) from exc

    def check(self, shell: str, timeout: float = 60.0) -> str:
        """``exec`` that raises GuestError (with the output) on a non-zero exit status."""
        rc, out = self.exec(shell, timeout)
        if rc != 0:
            raise GuestError(f"guest command failed with status {rc}: {shell}\n{out}")
        return out

    def stop(self) -> None:
        """Kill QEMU, wait for it and remove the run directory (the console log stays readable)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._rundir is not None:
            _ = self.console_log
            # KVTOOL_QEMU_KEEP=1 keeps the run directory (console.log, qemu.stderr) for debugging
            if not os.environ.get("KVTOOL_QEMU_KEEP"):
                shutil.rmtree(self._rundir, ignore_errors=True)
            self._rundir = None

    def __enter__(self) -> Guest:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Guest {state} target={self.target} ports={self._ports}>"
