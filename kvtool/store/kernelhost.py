"""NVMe-oF through the Linux kernel's host: connect, O_DIRECT on the block device, disconnect.

``open_kernel(url, write=…, qd=…)`` is what ``kvtool load/verify/bench/replay`` use for an
``nvme+rdma://`` URL, and for ``nvme+tcp://`` with ``--host kernel``: it connects the
namespace with :mod:`kvtool.nvme.kernel` (``/dev/nvme-fabrics``, like ``nvme connect``),
opens the block device with O_DIRECT (:class:`~kvtool.store.direct.DirectEngine`, native AIO)
and, on ``close()``, disconnects the controller it made. A controller that was already
connected to the same subsystem through the same address (``kvtool target connect``, or
``nvme connect``) is used as it is and left connected.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvtool.errors import AuthenticationFailed, UsageError
from kvtool.nvme import kernel
from kvtool.nvme.url import NvmeUrl, default_hostnqn, parse_nvme_url
from kvtool.store.direct import DirectEngine

if TYPE_CHECKING:
    from kvtool.nvme.hostauth import HostCredentials

HOSTS = ("kvtool", "kernel")


def connect_options(url: NvmeUrl, *, hostnqn: str | None = None, hostid: str | None = None,
                    credentials: HostCredentials | None = None,
                    nr_io_queues: int | None = None) -> kernel.ConnectOptions:
    """The kernel's connect options for ``url`` (host NQN: argument, credentials, URL,
    this machine's, as kvtool's userspace host chooses it)."""
    nqn = (hostnqn or (credentials.hostnqn if credentials else None) or url.hostnqn
           or default_hostnqn())
    return kernel.ConnectOptions(
        transport=url.transport, traddr=url.host, trsvcid=url.port, subnqn=url.subnqn,
        hostnqn=nqn, hostid=hostid or kernel.hostid_text(nqn), nr_io_queues=nr_io_queues,
        dhchap_secret=credentials.secret if credentials else None,
        dhchap_ctrl_secret=credentials.ctrl_secret if credentials else None)


def parse(target: str) -> NvmeUrl:
    url = parse_nvme_url(target, transports=("tcp", "rdma"))
    if url.alternates or url.discover_paths:
        raise UsageError(f"{target}: the kernel's host takes one address (it does multipath "
                         "itself: connect each path with kvtool target connect)", field="TARGET")
    return url


class KernelHostEngine:
    """A namespace attached by the kernel's host, read and written with O_DIRECT."""

    def __init__(self, url: NvmeUrl, ctrl: kernel.KernelController, inner: DirectEngine,
                 owned: bool) -> None:
        self.url = url
        self.controller = ctrl
        self.inner = inner
        self.owned = owned  # made by open_kernel: disconnected by close()
        self.size = inner.size
        self.lba_size = inner.lba_size
        self.mem_align = inner.mem_align
        self.qd = inner.qd
        self.writable = inner.writable
        self.path = inner.path

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.inner.read_into(offset, buf)

    def write_from(self, offset: int, buf: memoryview) -> None:
        self.inner.write_from(offset, buf)

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        return self.inner.submit_read(offset, buf)

    def submit_write(self, offset: int, buf: memoryview) -> Future[None]:
        return self.inner.submit_write(offset, buf)

    def submit_reads(self, items: Sequence[tuple[int, memoryview]], *,
                     on_caller: bool = False) -> Future[None]:
        return self.inner.submit_reads(items, on_caller=on_caller)

    def submit_writes(self, items: Sequence[tuple[int, memoryview]], *,
                      on_caller: bool = False) -> Future[None]:
        return self.inner.submit_writes(items, on_caller=on_caller)

    def reap(self) -> None:
        self.inner.reap()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            if self.owned:
                self.owned = False
                with contextlib.suppress(kernel.FabricsError):
                    kernel.disconnect(self.controller.name)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "target": str(self.url), "host": "kernel",
                "transport": self.url.transport, "controller": self.controller.name,
                "block_device": self.inner.path}

    def __enter__(self) -> KernelHostEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_error(target: str, opts: kernel.ConnectOptions,
                  exc: kernel.FabricsError) -> Exception:
    """The error a refused kernel connect becomes: AuthenticationFailed (exit 1) when the host
    presented a DH-HMAC-CHAP secret and the kernel reports a refusal, else UsageError
    (exit 2: nothing there, a wrong address or NQN), as for kvtool's userspace host."""
    if opts.dhchap_secret is not None and exc.errno in kernel.AUTH_ERRNOS:
        return AuthenticationFailed(
            f"DH-HMAC-CHAP: the target at {opts.traddr}:{opts.trsvcid} ({opts.subnqn}) refused "
            f"host {opts.hostnqn} through the kernel's {opts.transport} host: "
            f"{os.strerror(exc.errno or 0)}; check --dhchap-secret")
    return UsageError(f"{target}: {exc.strerror or exc}", field="TARGET")


def open_kernel(target: str, *, write: bool, qd: int, hostnqn: str | None = None,
                credentials: HostCredentials | None = None,
                submission: str = "auto") -> KernelHostEngine:
    """Connect ``target`` with the kernel's host and open its block device (O_DIRECT).

    A refused or failed connect is a UsageError naming ``TARGET`` (exit 2), as for
    kvtool's userspace host; the kernel's errno and its usual meaning are in the message.
    """
    url = parse(target)
    opts = connect_options(url, hostnqn=hostnqn, credentials=credentials)
    existing = kernel.find(url.transport, url.host, url.port, url.subnqn)
    owned = not existing
    try:
        ctrl = existing[0] if existing else kernel.connect(opts)
    except kernel.FabricsError as exc:
        raise connect_error(target, opts, exc) from None
    try:
        device = ctrl.block_device(url.nsid)
        inner = DirectEngine.open(device, write=write, qd=qd, submission=submission)
    except BaseException as exc:
        if owned:
            with contextlib.suppress(kernel.FabricsError):
                kernel.disconnect(ctrl.name)
        if isinstance(exc, kernel.FabricsError):
            raise UsageError(f"{target}: {exc.strerror or exc}", field="TARGET") from None
        raise
    return KernelHostEngine(url, ctrl, inner, owned)
