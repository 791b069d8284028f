"""What ``kvtool cluster up`` runs on a node, whatever the node is (a network namespace on
this machine, or a host of the user's Ray cluster): ports, names, the config of a cluster
target and the command lines of Mooncake's processes.

Every process of a cluster carries ``KVTOOL_CLUSTER=<name>`` (:data:`ENV_TAG`) in its
environment, so ``down`` finds what it started (and their children) and nothing else.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import replace
from pathlib import Path

from kvtool.target.config import Host, Listener, Namespace, Subsystem, TargetConfig
from kvtool.target.loader import load_config
from kvtool.target.runtimes import CLUSTER

ENV_TAG = "KVTOOL_CLUSTER"
RAY_PORT = 6379
TARGET_PORT = 4420
MOONCAKE_RPC_PORT = 50051
MOONCAKE_METADATA_PORT = 8080
MOONCAKE_CLIENT_PORT = 50052
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
HOST_NQN_PREFIX = "nqn.2014-08.io.kvtool:cluster"
SUB_NQN_PREFIX = "nqn.2026-01.io.kvtool:cluster"


def target_config(name: str, runtime: str, subnqn: str, size: int, config: str | None,
                  host: Host, address: str, port: int) -> TargetConfig:
    """One cluster target: ``config``'s subsystems (or one subsystem ``subnqn`` with a
    memory namespace of ``size``), listening on ``address:port`` only, allowing only
    ``host``, with its keys."""
    if config is None:
        subsystems: tuple[Subsystem, ...] = (
            Subsystem(subnqn, (Namespace(1, "memory", size=size),)),)
    else:
        own = load_config(config, allow_remote=True)
        subsystems = own.subsystems
        runtime = own.runtime if own.runtime in CLUSTER else runtime
    subsystems = tuple(replace(sub, hosts=(host.nqn,), allow_any_host=False)
                       for sub in subsystems)
    listener = Listener(1, "tcp", address, port, "ipv4", tuple(sub.nqn for sub in subsystems))
    return TargetConfig(name=name, backend="emulator", subsystems=subsystems,
                        listeners=(listener,), hosts=(host,),
                        runtime=runtime if runtime in CLUSTER else CLUSTER[0])


def metadata_args(address: str) -> list[str]:
    """``mooncake_http_metadata_server``'s arguments: it listens on ``address`` only."""
    return ["--host", address, "--port", str(MOONCAKE_METADATA_PORT), "--log-level",
            "WARNING"]


def master_args(address: str) -> list[str]:
    """``mooncake_master``'s arguments: RPC and metrics on ``address``."""
    return [f"--rpc_address={address}", f"--rpc_port={MOONCAKE_RPC_PORT}",
            f"--metrics_host={address}"]


def segment_args(address: str, size: int, master: str, metadata: str) -> list[str]:
    """``mooncake_client``'s arguments: it lends ``size`` bytes to the pool of ``master``."""
    return [f"--host={address}", f"--global_segment_size={size >> 20}MB",
            f"--master_server_address={master}", f"--metadata_server={metadata}",
            "--protocol=tcp", f"--port={MOONCAKE_CLIENT_PORT}"]


def listening(host: str, port: int) -> bool:
    """Does something accept TCP connections on ``host:port``?"""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


_ERROR_LINE = re.compile(r"[EF]\d{4} |.*\b(ERROR|FATAL|CRITICAL)\b")
"""glog's error and fatal lines (``E1203 00:51:32.254616 …``), and lines that say ERROR,
FATAL or CRITICAL (SPDK's ``*ERROR*``, Python's logging, Ray's)."""


def log_reason(path: Path) -> str:
    """Why a process stopped, from its log, for an error (at most 200 characters): the
    last error line (glog's ``E`` or ``F`` lines, as Mooncake writes them, or a line
    that says ERROR: the cause, where a process logs more lines on its way out), or else
    the last line (:func:`last_line`)."""
    lines = _lines(path)
    errors = [x for x in lines if _ERROR_LINE.match(x)]
    return _last(errors or lines, path)


def last_line(path: Path) -> str:
    """The last non-empty line of a log (at most 200 characters), for an error: kvtool's
    own one-line error, where the log is a kvtool command's standard error."""
    return _last(_lines(path), path)


def _lines(path: Path) -> list[str]:
    """The non-empty lines of a log ([] when there is none)."""
    try:
        return [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return []


def _last(lines: list[str], path: Path) -> str:
    if not lines:
        return "empty log" if path.exists() else "no log"
    return lines[-1][-200:]


def tagged_pids(name: str) -> list[int]:
    """This machine's processes carrying ``KVTOOL_CLUSTER=<name>`` (started for the
    cluster, and their children); never the caller."""
    mark = f"{ENV_TAG}={name}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    out.append(int(entry.name))
        except OSError:
            continue
    return out
