"""The FX100 measurement: KV chunks read from the NVMe tier one at a time vs in parallel.

``requests`` concurrent requests each need ``tokens_per_request / chunk_tokens`` KV chunks
that sit on the NVMe tier (a cold read). The chunks are written once, then read back
twice through kvtool's store engines — with ``serial_qd`` reads in flight (one at a
time: the loader before the published patch), then ``parallel_qd`` — in the order a
fair loader serves concurrent requests (round robin over the requests' chunks).

Per mode: GB/s (bytes over wall time) and TTFT, the mean over requests of the moment
the request's last chunk arrived (plus the modelled prefill of its tokens beyond the
cached chunks, none here: the prompts are fully cached). Every chunk read is checked
against the bytes written (first and last 4 KiB, which carry the chunk's key).

Targets, each measured when this machine allows it (otherwise the row says why):

* ``file`` — a regular file with O_DIRECT (``--scratch`` must be a real filesystem);
* ``loop`` — a loop device with direct I/O over such a file (needs root and losetup);
* ``nvme-tcp`` — a namespace of kvtool's userspace NVMe/TCP target on 127.0.0.1
  (memory-backed: its "medium" is the target's RAM, so it measures the protocol path).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtool.errors import InputError
from kvtool.experiments.figures import RunData
from kvtool.experiments.spec import Experiment, block_bytes_of

CHECK_BYTES = 4096
NQN = "nqn.2026-01.io.kvtool:fx100"


def _stamp(key: int, nbytes: int) -> np.ndarray:
    """The bytes a chunk's head and tail carry: the key, then a key-seeded pattern."""
    rng = np.random.default_rng(key + 1)
    a = rng.integers(0, 256, nbytes, dtype=np.uint8)
    a[:8] = np.frombuffer(int(key).to_bytes(8, "little"), dtype=np.uint8)
    return a


@contextlib.contextmanager
def _file_target(scratch: Path, nbytes: int) -> Iterator[str]:
    path = scratch / "fx100-chunks.img"
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    try:
        yield str(path)
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _loop_target(scratch: Path, nbytes: int) -> Iterator[str]:
    if os.geteuid() != 0:
        raise _Skip("loop devices need root")
    if shutil.which("losetup") is None:
        raise _Skip("losetup (util-linux) is not installed")
    with _file_target(scratch, nbytes) as backing:
        out = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", backing],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise _Skip(f"losetup failed: {out.stderr.strip()}")
        dev = out.stdout.strip()
        try:
            yield dev
        finally:
            subprocess.run(["losetup", "-d", dev], capture_output=True, check=False)


@contextlib.contextmanager
def _nvme_tcp_target(scratch: Path, nbytes: int) -> Iterator[str]:
    from emulator.nvmetcp.spawn import TargetStartError, spawned

    args = ["--listen", "127.0.0.1:0", "--nqn", NQN, "--backing", str(nbytes),
            "--allow-any-host"]
    try:
        with spawned(args, workdir=scratch) as target:
            yield target.url()
    except TargetStartError as exc:
        raise _Skip(f"the emulator target did not start: {exc}") from None


class _Skip(Exception):
    """This target cannot be measured on this machine (the reason is reported)."""


_TARGETS = {"file": _file_target, "loop": _loop_target, "nvme-tcp": _nvme_tcp_target}


def _pump(engine: Any, order: list[int], slot_bytes: int, qd: int, chunk_bytes: int,
          stamps: list[np.ndarray], *, write: bool, requests: int,
          per_request: int) -> tuple[float, list[float], int]:
    """Move every chunk of ``order`` with ``qd`` in flight; return (seconds, per-request
    completion seconds, bad chunks)."""
    from kvtool.store.engine import AlignedBuffer

    bufs = [AlignedBuffer(slot_bytes) for _ in range(qd)]
    free: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
    for b in bufs:
        free.put(b)
    done: queue.SimpleQueue[tuple[int, AlignedBuffer, Any, float]] = queue.SimpleQueue()
    left = [per_request] * requests
    finish = [0.0] * requests
    bad = 0
    t0 = time.perf_counter()

    def handle() -> None:
        nonlocal bad
        idx, buf, fut, t = done.get()
        exc = fut.exception()
        if exc is not None:
            raise exc
        if not write:
            view = np.frombuffer(buf.view, dtype=np.uint8)
            s = stamps[idx]
            if not (np.array_equal(view[:CHECK_BYTES], s[:CHECK_BYTES])
                    and np.array_equal(view[chunk_bytes - CHECK_BYTES:chunk_bytes],
                                       s[CHECK_BYTES:])):
                bad += 1
        free.put(buf)
        r = idx % requests
        left[r] -= 1
        if not left[r]:
            finish[r] = t - t0

    inflight = 0
    try:
        for idx in order:
            if inflight >= qd:
                handle()
                inflight -= 1
            buf = free.get()
            if write:
                view = np.frombuffer(buf.view, dtype=np.uint8)
                s = stamps[idx]
                view[:CHECK_BYTES] = s[:CHECK_BYTES]
                view[chunk_bytes - CHECK_BYTES:chunk_bytes] = s[CHECK_BYTES:]
                fut = engine.submit_write(idx * slot_bytes, buf.view)
            else:
                fut = engine.submit_read(idx * slot_bytes, buf.view)
            fut.add_done_callback(
                lambda f, idx=idx, buf=buf: done.put((idx, buf, f, time.perf_counter())))
            inflight += 1
        while inflight:
            handle()
            inflight -= 1
        if write:
            engine.flush()
        return time.perf_counter() - t0, finish, bad
    finally:
        while inflight:
            done.get()
            inflight -= 1
        for b in bufs:
            b.close()


def measure_target(kind: str, scratch: Path, *, requests: int, per_request: int,
                   chunk_bytes: int, serial_qd: int, parallel_qd: int, repeats: int = 1,
                   prefill_s: float = 0.0) -> dict[str, Any]:
    """One target: write the chunks, then read them serially and in parallel."""
    from kvtool.store.engine import open_engine

    n = requests * per_request
    slot = -(-chunk_bytes // 4096) * 4096
    stamps = []
    for k in range(n):
        s = _stamp(k, 2 * CHECK_BYTES)
        stamps.append(s)
    # Round robin over the requests: chunk c of request r is index c·requests + r.
    order = list(range(n))
    with _TARGETS[kind](scratch, n * slot + (1 << 20)) as where:
        engine = open_engine(where, write=True, qd=max(serial_qd, parallel_qd))
        try:
            _pump(engine, order, slot, parallel_qd, chunk_bytes, stamps, write=True,
                  requests=requests, per_request=per_request)
            out: dict[str, Any] = {"where": where if kind != "file" else "O_DIRECT file",
                                   "engine": engine.describe()}
            for mode, qd in (("serial", serial_qd), ("parallel", parallel_qd)):
                best: dict[str, Any] | None = None
                for _ in range(max(1, repeats)):
                    secs, finish, bad = _pump(engine, order, slot, qd, chunk_bytes, stamps,
                                              write=False, requests=requests,
                                              per_request=per_request)
                    if bad:
                        raise InputError(f"{kind}: {bad} chunks read back wrong")
                    row = {"qd": qd, "chunks": n, "bytes": n * chunk_bytes, "seconds": secs,
                           "gbps": n * chunk_bytes / secs / 1e9,
                           "ttft_s": sum(finish) / len(finish) + prefill_s,
                           "ttft_max_s": max(finish) + prefill_s}
                    if best is None or row["seconds"] < best["seconds"]:
                        best = row
                out[mode] = best
            return out
        finally:
            engine.close()


def run_parallel_read(exp: Experiment, *, scratch: Path, progress: Any = None) -> RunData:

    w = exp.workload
    chunk_bytes = int(w.get("chunk_bytes") or block_bytes_of(exp) or 0)
    if chunk_bytes < 2 * CHECK_BYTES:
        raise InputError(f"chunks of {chunk_bytes} B are too small to check (at least "
                         f"{2 * CHECK_BYTES} B)", file=exp.path, field="workload.chunk_bytes")
    per_request = -(-w["tokens_per_request"] // w["chunk_tokens"])
    scratch.mkdir(parents=True, exist_ok=True)
    data = RunData(mode="measure", workload=w, block_bytes=chunk_bytes)
    skipped: dict[str, str] = {}
    targets = list(w["targets"])
    bar = progress(f"{exp.name}: targets", len(targets)) if progress else contextlib.nullcontext()
    with bar as advance:
        for kind in targets:
            try:
                data.reads[kind] = measure_target(
                    kind, scratch, requests=w["requests"], per_request=per_request,
                    chunk_bytes=chunk_bytes, serial_qd=w.get("serial_qd", 1),
                    parallel_qd=w.get("parallel_qd", 16), repeats=w.get("repeats", 1))
            except _Skip as exc:
                skipped[kind] = str(exc)
            except OSError as exc:
                skipped[kind] = f"{exc.strerror or exc}"
            if advance is not None:
                advance(1)
    if skipped:
        data.reads["_skipped"] = skipped
    return data
