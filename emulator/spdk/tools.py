"""SPDK's NVMe-oF host tools (spdk_nvme_identify, spdk_nvme_perf, spdk_nvme_discover) as
library calls, with their output parsed.

Each tool is a DPDK application: it runs without hugepages (``--no-huge -s MEM``) on its own
core (``0x2`` by default, the target having ``0x1``), under a timeout, since a host that
loses its controller may wait forever.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.target.spdk.app import SpdkApp
from kvtool.target.spdk.install import SpdkInstall, die_with_parent

HOST_CORE_MASK = "0x2"
HOST_MEM_MB = 512
# spdk_nvme_perf frees its I/O qpairs while its poll group still polls them, which logs
# this once per qpair at exit; it does so against SPDK's own nvmf_tgt too.
_EXIT_NOISE = re.compile(r"qid:[1-9]\d*,qpair:\S+,DISCONNECTED\] CQ transport error -6 ")
_TOTAL = re.compile(r"^Total\s*:\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", re.M)


def trid(host: str, port: int, subnqn: str, hostnqn: str | None = None,
         trtype: str = "TCP") -> str:
    """A transport ID string (TCP, or ``trtype="RDMA"``) as SPDK's tools take it (``-r``)."""
    out = f"trtype:{trtype} adrfam:IPv4 traddr:{host} trsvcid:{port} subnqn:{subnqn}"
    return out + (f" hostnqn:{hostnqn}" if hostnqn else "")


@dataclass
class ToolRun:
    """One run of an SPDK host tool: its command, exit status and output."""

    command: list[str]
    returncode: int
    output: str
    timed_out: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.errors


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if ("*ERROR*" in line or line.startswith("ERROR")) and not _EXIT_NOISE.search(line)]


# Runs a command somewhere else (e.g. in the QEMU guest): (argv, timeout) -> (status, output);
# a timeout is reported as status -9.
Runner = Callable[[list[str], float], tuple[int, str]]


def run_tool(install: SpdkInstall, name: str, args: list[str], timeout: float = 60.0,
             runner: Runner | None = None) -> ToolRun:
    """Run a host tool to completion; on timeout it is killed, and it dies with its caller.
    ``runner`` runs it elsewhere (the QEMU guest) instead of as a child of this process."""
    cmd = [str(install.bin(name)), *args]
    if runner is not None:
        rc, text = runner(cmd, timeout)
        return ToolRun(cmd, rc, text, timed_out=rc == -9, errors=_error_lines(text))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                             env=install.env(), timeout=timeout, stdin=subprocess.DEVNULL,
                             preexec_fn=die_with_parent)
    except subprocess.TimeoutExpired as exc:  # run() has killed it
        text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                       for part in (exc.stdout or "", exc.stderr or ""))
        return ToolRun(cmd, -9, text, timed_out=True, errors=_error_lines(text))
    text = out.stdout + out.stderr
    return ToolRun(cmd, out.returncode, text, errors=_error_lines(text))


def identify(install: SpdkInstall, transport_id: str, timeout: float = 60.0,
             runner: Runner | None = None) -> ToolRun:
    """``spdk_nvme_identify``: controller and namespace data as SPDK's host reads them."""
    return run_tool(install, "spdk_nvme_identify",
                    ["--no-huge", "-s", str(HOST_MEM_MB), "-p", "1", "-r", transport_id],
                    timeout, runner)


def discover(install: SpdkInstall, transport_id: str, timeout: float = 60.0) -> ToolRun:
    """``spdk_nvme_discover`` against a discovery controller (``subnqn`` the discovery NQN)."""
    return run_tool(install, "spdk_nvme_discover",
                    ["--no-huge", "-s", str(HOST_MEM_MB), "-r", transport_id], timeout)


@dataclass
class PerfResult:
    run: ToolRun
    workload: str
    qd: int
    io_size: int
    iops: float = 0.0
    mib_s: float = 0.0
    avg_us: float = 0.0
    min_us: float = 0.0
    max_us: float = 0.0

    @property
    def gb_s(self) -> float:
        return self.mib_s * 1024 * 1024 / 1e9


def perf(install: SpdkInstall, transport_id: str, *, workload: str = "randread", qd: int = 32,
         io_size: int = 4096, seconds: int = 3, read_pct: int = 50,
         core_mask: str = HOST_CORE_MASK, timeout: float | None = None,
         dhchap_key_file: str | None = None, dhchap_ctrlr_key_file: str | None = None,
         runner: Runner | None = None) -> PerfResult:
    """``spdk_nvme_perf`` (one I/O queue on one core); ``read_pct`` applies to ``randrw``;
    the key files (DH-HMAC-CHAP) are passed by path, so no secret reaches argv."""
    args = ["--no-huge", "-s", str(HOST_MEM_MB), "-c", core_mask, "-q", str(qd),
            "-o", str(io_size), "-w", workload, "-t", str(seconds), "-r", transport_id]
    for option, path in (("--dhchap-key", dhchap_key_file),
                         ("--dhchap-ctrlr-key", dhchap_ctrlr_key_file)):
        if path is not None:
            args[:0] = [option, path]
    if workload.endswith("rw"):
        args[-2:-2] = ["-M", str(read_pct)]
    run = run_tool(install, "spdk_nvme_perf", args, timeout or seconds + 30, runner)
    result = PerfResult(run, workload, qd, io_size)
    m = _TOTAL.search(run.output)
    if m:
        result.iops, result.mib_s, result.avg_us, result.min_us, result.max_us = (
            float(g) for g in m.groups())
    elif run.returncode == 0:
        run.errors.append("spdk_nvme_perf printed no Total line")
    return result


def serve_malloc(app: SpdkApp, nqn: str, port: int, size: int, block_size: int = 512,
                 host: str = "127.0.0.1") -> None:
    """On a started ``nvmf_tgt``: the TCP transport and one subsystem ``nqn`` that admits
    any host, its namespace a malloc bdev of ``size`` bytes, listening on ``host:port``."""
    app.rpc("nvmf_create_transport", {"trtype": "TCP"})
    app.rpc("bdev_malloc_create", {"name": "Mal0", "num_blocks": size // block_size,
                                   "block_size": block_size})
    app.rpc("nvmf_create_subsystem", {"nqn": nqn, "allow_any_host": True})
    app.rpc("nvmf_subsystem_add_ns", {"nqn": nqn, "namespace": {"bdev_name": "Mal0"}})
    app.rpc("nvmf_subsystem_add_listener", {"nqn": nqn, "listen_address": {
        "trtype": "TCP", "adrfam": "IPv4", "traddr": host, "trsvcid": str(port)}})


def nvme_bdev_config(name: str, host: str, port: int, subnqn: str,
                     hostnqn: str | None = None, dhchap_key_file: str | None = None,
                     dhchap_ctrlr_key_file: str | None = None) -> dict[str, object]:
    """An SPDK ``--json`` config whose only bdev is an NVMe-oF controller's namespaces
    (bdevs ``<name>n1``, ``<name>n2``, …), attached over TCP. With key files (DHHC-1,
    mode 0600) the host authenticates with DH-HMAC-CHAP (keyring_file keys ``<name>-key``,
    ``<name>-ckey``; the controller key makes it bidirectional)."""
    params: dict[str, object] = {"name": name, "trtype": "tcp", "adrfam": "ipv4",
                                 "traddr": host, "trsvcid": str(port), "subnqn": subnqn}
    if hostnqn:
        params["hostnqn"] = hostnqn
    keys = []
    for option, suffix, path in (("dhchap_key", "key", dhchap_key_file),
                                 ("dhchap_ctrlr_key", "ckey", dhchap_ctrlr_key_file)):
        if path:
            keys.append({"method": "keyring_file_add_key",
                         "params": {"name": f"{name}-{suffix}", "path": path}})
            params[option] = f"{name}-{suffix}"
    subsystems: list[dict[str, object]] = [{"subsystem": "bdev", "config": [
        {"method": "bdev_nvme_attach_controller", "params": params}]}]
    if keys:
        subsystems.insert(0, {"subsystem": "keyring", "config": keys})
    return {"subsystems": subsystems}


def dd(install: SpdkInstall, config: Path, args: list[str], timeout: float = 120.0,
       core_mask: str = HOST_CORE_MASK) -> ToolRun:
    """``spdk_dd`` between files and bdevs (``--if/--of/--ib/--ob``), bdevs from ``config``.

    spdk_dd ignores the status of its bdev reads and writes (SPDK v26.05): a failed I/O is
    counted as copied and exits 0. Check the bytes, never only the exit status."""
    return run_tool(install, "spdk_dd",
                    ["--no-huge", "-s", str(HOST_MEM_MB), "-m", core_mask, "--no-rpc-server",
                     "--disable-cpumask-locks",
                     "--json", str(config), *args], timeout)
