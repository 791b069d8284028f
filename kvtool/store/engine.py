"""``open_engine``: the I/O engine for a target (a path, or an ``nvme+tcp://`` URL).

The engines (:mod:`kvtool.store.direct`, :mod:`kvtool.nvme.engine`) import only the leaf
:mod:`kvtool.store.io`; this module imports them, on first use. The names of
:mod:`kvtool.store.io` are re-exported here for callers that only open and use engines.
"""

from __future__ import annotations

import os
import re
from typing import Any

from kvtool.errors import UsageError, param
from kvtool.store.io import (
    DEFAULT_QD,
    PAGE_SIZE,
    AlignedBuffer,
    IOEngine,
    ThreadedEngine,
    buffer_address,
    check_extent,
    submit_batch,
)

__all__ = ["DEFAULT_QD", "NVME_RDMA_SCHEME", "NVME_TCP_SCHEME", "PAGE_SIZE", "AlignedBuffer", "IOEngine",
           "ThreadedEngine", "buffer_address", "check_extent", "open_engine",
           "submit_batch"]

NVME_TCP_SCHEME = "nvme+tcp://"
NVME_RDMA_SCHEME = "nvme+rdma://"
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
"""A URL-looking target that is not an existing path (e.g. ``nvme+rdma://``)."""


def open_engine(target: str, *, write: bool, qd: int = DEFAULT_QD, **opts: Any) -> IOEngine:
    """Open ``target`` for I/O: a block device or regular file path (O_DIRECT), or an
    ``nvme+tcp://HOST:PORT/SUBNQN[/NSID]`` URL (kvtool's userspace NVMe/TCP host).

    Raises :class:`~kvtool.errors.UsageError` (exit 2, field ``TARGET``) when the target is
    missing, not a file or block device, read-only while ``write`` is asked, or cannot do
    O_DIRECT. ``opts``: ``hostnqn`` and ``credentials`` (a
    :class:`kvtool.nvme.hostauth.HostCredentials`: host NQN, DH-HMAC-CHAP secrets) for
    NVMe/TCP; for paths, ``create_bytes`` creates a missing regular file of that size and
    ``lba`` overrides the logical block size (a power-of-two multiple of the device's, e.g.
    to lay out a 4Kn store on a 512 B file; both are UsageErrors for an NVMe/TCP URL rather
    than silently ignored);
    ``submission`` ("auto", "aio", "threads") picks how the O_DIRECT engine keeps ``qd``
    requests in flight (native AIO when available, else a thread pool).

    ``nvme+rdma://HOST:PORT/SUBNQN[/NSID]`` URLs, and ``nvme+tcp://`` ones with
    ``host="kernel"``, go through the Linux kernel's NVMe-oF host
    (:mod:`kvtool.store.kernelhost`): connect, O_DIRECT on the block device, disconnect on
    ``close()``.
    """
    creds = opts.get("credentials")
    host = opts.get("host") or (creds.initiator if creds is not None else None) or "kvtool"
    if host not in ("kvtool", "kernel"):
        raise UsageError(f"unknown NVMe-oF host {host!r} (kvtool or kernel)", field="host")
    if target.startswith(NVME_RDMA_SCHEME) or (host == "kernel"
                                               and target.startswith(NVME_TCP_SCHEME)):
        if target.startswith(NVME_RDMA_SCHEME) and opts.get("host") == "kvtool":  # explicit
            raise UsageError(f"{target}: kvtool's own host speaks NVMe/TCP only; "
                             f"{NVME_RDMA_SCHEME} URLs use the kernel's host "
                             f"({param('host')} kernel)", field="host")
        for key, name in (("create_bytes", "create"), ("lba", "lba")):
            if opts.get(key):
                raise UsageError(f"{target}: {param(name)} applies to a regular file or block "
                                 "device, not an NVMe-oF namespace", field=name)
        from kvtool.store.kernelhost import open_kernel  # the kernel's host: only when asked

        kengine: IOEngine = open_kernel(target, write=write, qd=qd, hostnqn=opts.get("hostnqn"),
                                        credentials=opts.get("credentials"),
                                        submission=opts.get("submission") or "auto")
        return kengine
    if target.startswith(NVME_TCP_SCHEME):
        from kvtool.nvme.engine import open_nvme_tcp  # the NVMe/TCP host: only when asked

        if opts.get("create_bytes"):
            raise UsageError(f"{target}: an NVMe/TCP namespace cannot be created; "
                             f"{param('create')} applies to a regular file", field="create")
        if opts.get("lba"):
            raise UsageError(f"{target}: an NVMe/TCP namespace has its own logical block "
                             f"size; {param('lba')} applies to a file or block device", field="lba")
        engine: IOEngine = open_nvme_tcp(target, write=write, qd=qd,
                                         hostnqn=opts.get("hostnqn"),
                                         credentials=opts.get("credentials"))
        return engine
    scheme = _URL_SCHEME.match(target)
    if scheme and not os.path.lexists(target):
        raise UsageError(f"{target}: unsupported URL scheme {scheme.group(0)!r}; kvtool reads "
                         f"and writes {NVME_TCP_SCHEME}HOST:PORT/SUBNQN[/NSID] and "
                         f"{NVME_RDMA_SCHEME}HOST:PORT/SUBNQN[/NSID]", field="target")
    from kvtool.store.direct import DirectEngine

    return DirectEngine.open(target, write=write, qd=qd, lba=opts.get("lba"),
                             create_bytes=opts.get("create_bytes"),
                             submission=opts.get("submission") or "auto")
