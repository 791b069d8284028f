"""``nvme+tcp://HOST:PORT[,HOST:PORT...]/SUBNQN[/NSID][?hostnqn=NQN]`` URLs (and
``nvme+rdma://`` ones, for the kernel's host) and the default host NQN.

Several comma-separated addresses name several paths to the same subsystem (ANA
multipath, :mod:`kvtool.nvme.multipath`); the first is ``host``/``port``, all of them are
``paths``. ``?paths=discover`` adds the subsystem's other addresses from the discovery log
of each address (and of the discovery controllers it refers to).

Default host NQN (stable per machine), first match wins:

1. the ``KVTOOL_HOSTNQN`` environment variable;
2. ``/etc/nvme/hostnqn`` (what nvme-cli and the kernel initiator use), if it holds an NQN;
3. ``nqn.2014-08.org.nvmexpress:uuid:<UUID>`` with UUID = uuid5 of ``/etc/machine-id``
   (or of the hostname when there is no machine-id), so it never changes between runs.

The host ID sent in Connect is the UUID inside a ``...:uuid:<UUID>`` host NQN, otherwise a
uuid5 of the NQN: the same NQN always presents the same host ID.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote

from kvtool.errors import UsageError
from kvtool.nvme.spec import NQN_MAX, nqn_problem

SCHEME = "nvme+tcp://"
SCHEMES = {"tcp": SCHEME, "rdma": "nvme+rdma://"}
DEFAULT_PORT = 4420
_NS = uuid.UUID("0b1d1b5e-7a6e-4c1f-8c55-6b76746f6f6c")
UUID_NQN_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"


@dataclass(frozen=True)
class NvmeUrl:
    host: str
    port: int
    subnqn: str
    nsid: int | None = None
    hostnqn: str | None = None
    alternates: tuple[tuple[str, int], ...] = ()  # more paths after (host, port)
    discover_paths: bool = False  # ?paths=discover: more paths from the discovery log
    transport: str = "tcp"  # "tcp" | "rdma" (nvme+rdma://: the kernel's host only)

    @property
    def paths(self) -> tuple[tuple[str, int], ...]:
        return ((self.host, self.port), *self.alternates)

    def __str__(self) -> str:
        addrs = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.paths)
        tail = f"/{self.nsid}" if self.nsid is not None else ""
        query = "?paths=discover" if self.discover_paths else ""
        return f"{SCHEMES[self.transport]}{addrs}/{self.subnqn}{tail}{query}"


def check_nqn(nqn: str, *, field: str) -> str:
    """``nqn``, or a UsageError naming ``field`` (the rule: :func:`kvtool.nvme.spec.nqn_problem`)."""
    problem = nqn_problem(nqn)
    if problem:
        raise UsageError(problem, field=field)
    return nqn


def parse_nvme_url(url: str, *, field: str = "TARGET",
                   transports: tuple[str, ...] = ("tcp",)) -> NvmeUrl:
    """Parse ``nvme+tcp://HOST:PORT[,HOST:PORT...]/SUBNQN[/NSID][?hostnqn=NQN]`` (and
    ``nvme+rdma://…`` when ``transports`` has ``"rdma"``); raise UsageError naming ``field``.

    PORT defaults to 4420; IPv6 hosts go in brackets; several addresses are several paths.
    NSID must be a positive integer (namespace 1 is used when absent, by the engine).
    """
    transport = next((t for t in transports if url.startswith(SCHEMES[t])), None)
    if transport is None:
        forms = " or ".join(f"{SCHEMES[t]}HOST:PORT/SUBNQN[/NSID]" for t in transports)
        kind = "NVMe/TCP" if transports == ("tcp",) else "NVMe-oF"
        raise UsageError(f"{url!r} is not an {kind} URL ({forms})", field=field)
    scheme = SCHEMES[transport]
    rest = url[len(scheme):]
    rest, _, query = rest.partition("?")
    hostport, slash, path = rest.partition("/")
    if not slash or not path:
        raise UsageError(f"{url!r}: the subsystem NQN is missing ({scheme}HOST:PORT/SUBNQN)",
                         field=field)
    paths = [_host_port(url, part, field) for part in hostport.split(",")]
    if len(set(paths)) != len(paths):
        raise UsageError(f"{url!r}: an address is given twice", field=field)
    path = unquote(path)
    subnqn, nsid = path, None
    head, sep, last = path.rpartition("/")
    if sep:
        if not last.isdigit() or int(last) == 0 or int(last) >= 0xFFFFFFFF:
            raise UsageError(f"{url!r}: {last!r} is not a namespace ID (1, 2, ...)", field=field)
        subnqn, nsid = head, int(last)
    check_nqn(subnqn, field=field)
    hostnqn = None
    if query:
        params = parse_qs(query, keep_blank_values=True)
        unknown = set(params) - {"hostnqn", "paths"}
        if unknown:
            raise UsageError(f"{url!r}: unknown parameter {sorted(unknown)[0]!r} "
                             "(only hostnqn=, paths=discover)", field=field)
        if "hostnqn" in params:
            hostnqn = check_nqn(params["hostnqn"][-1], field=field)
        if "paths" in params and params["paths"][-1] != "discover":
            raise UsageError(f"{url!r}: paths= takes only 'discover'", field=field)
    (host, port), *alternates = paths
    return NvmeUrl(host, port, subnqn, nsid, hostnqn, tuple(alternates),
                   discover_paths=bool(query) and "paths" in parse_qs(query), transport=transport)


def _host_port(url: str, hostport: str, field: str) -> tuple[str, int]:
    if hostport.startswith("["):
        host, close, after = hostport[1:].partition("]")
        if not close or (after and not after.startswith(":")):
            raise UsageError(f"{url!r}: bad IPv6 address (use [addr]:port)", field=field)
        port_text = after[1:]
    else:
        host, _, port_text = hostport.partition(":")
    if not host:
        raise UsageError(f"{url!r}: the host is missing", field=field)
    port = DEFAULT_PORT
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise UsageError(f"{url!r}: {port_text!r} is not a TCP port", field=field)
        port = int(port_text)
    return host, port


def default_hostnqn() -> str:
    """The machine's stable host NQN (see the module docstring for the order)."""
    env = os.environ.get("KVTOOL_HOSTNQN")
    if env:
        return check_nqn(env.strip(), field="KVTOOL_HOSTNQN")
    try:
        text = Path("/etc/nvme/hostnqn").read_text().strip()
        if text.startswith("nqn.") and len(text) <= NQN_MAX:
            return text
    except OSError:
        pass
    try:
        seed = Path("/etc/machine-id").read_text().strip()
    except OSError:
        seed = ""
    if not seed:
        seed = "host:" + socket.gethostname()
    return UUID_NQN_PREFIX + str(uuid.uuid5(_NS, seed))


def hostid_for(hostnqn: str) -> bytes:
    """16-byte host ID: the UUID of a ``...:uuid:<UUID>`` NQN, else uuid5 of the NQN."""
    if hostnqn.startswith(UUID_NQN_PREFIX):
        try:
            return uuid.UUID(hostnqn[len(UUID_NQN_PREFIX):]).bytes
        except ValueError:
            pass
    return uuid.uuid5(_NS, hostnqn).bytes
