"""Network namespaces as nodes: a bridge in the root namespace, a veth pair per node.

Everything here is made by kvtool and named after the cluster, so nothing else is touched:

* the bridge ``kvb<h>`` (``h``: 6 hex digits of the cluster name's SHA-1) holds the
  subnet's first address, so commands in the root namespace reach the nodes;
* a node's namespace ``kvtool-<cluster>-<node>`` holds ``lo`` and ``eth0`` (the inner end
  of the veth pair ``kv<h>n<i>``, whose outer end is enslaved to the bridge), with the
  node's private address;
* ``tc qdisc ... tbf`` on both ends of a node's veth shapes its link in each direction.

Functions raise :class:`~kvtool.cluster.errors.ClusterError` with the command's own message.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Sequence

from kvtool.cluster.errors import ClusterError

IP = "ip"
TC = "tc"


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise ClusterError(f"{argv[0]} not found: {exc}") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(argv)}: no answer in 30 s") from None
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"{' '.join(argv)}: {msg[-1] if msg else f'exit {proc.returncode}'}")
    return proc


def tag(cluster: str) -> str:
    """6 hex digits naming the cluster's interfaces (Linux allows 15 characters)."""
    return hashlib.sha1(cluster.encode()).hexdigest()[:6]


def bridge_name(cluster: str) -> str:
    return f"kvb{tag(cluster)}"


def veth_name(cluster: str, index: int) -> str:
    return f"kv{tag(cluster)}n{index}"


def netns_name(cluster: str, node: str) -> str:
    return f"kvtool-{cluster}-{node}"


def available() -> str | None:
    """Why namespaces cannot be made here (``None``: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    proc = _run([IP, "netns", "list"], check=False)
    if proc.returncode != 0:
        return f"ip netns is unavailable: {proc.stderr.strip()}"
    return None


def subnet_user(subnet: str) -> str | None:
    """The interface of the root namespace with an address in ``subnet`` (``None``: free)."""
    import ipaddress

    net = ipaddress.IPv4Network(subnet)
    for line in _run([IP, "-o", "-4", "addr", "show"]).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            iface = ipaddress.IPv4Interface(words[words.index("inet") + 1])
            if iface.network.overlaps(net):
                return words[1]
    return None


def namespaces() -> list[str]:
    out = _run([IP, "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def link_exists(name: str, netns: str | None = None) -> bool:
    argv = [IP, "link", "show", name] if netns is None else \
        [IP, "-n", netns, "link", "show", name]
    return _run(argv, check=False).returncode == 0


def netns_pids(name: str) -> list[int]:
    """Processes whose network namespace is ``name`` (``ip netns pids``)."""
    proc = _run([IP, "netns", "pids", name], check=False)
    if proc.returncode != 0:
        return []
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def add_bridge(name: str, address: str, prefix: int) -> None:
    _run([IP, "link", "add", name, "type", "bridge"])
    _run([IP, "addr", "add", f"{address}/{prefix}", "dev", name])
    _run([IP, "link", "set", name, "up"])


def add_netns(name: str) -> None:
    _run([IP, "netns", "add", name])
    _run([IP, "-n", name, "link", "set", "lo", "up"])


def add_node_link(netns: str, veth: str, bridge: str, address: str, prefix: int,
                  gateway: str) -> None:
    """The veth pair ``veth`` (root end, on ``bridge``) / ``eth0`` (in ``netns``).

    The caller records ``veth`` before calling: a failure half-way leaves at most that pair.
    """
    peer = f"{veth}p"
    _run([IP, "link", "add", veth, "type", "veth", "peer", "name", peer])
    _run([IP, "link", "set", peer, "netns", netns])
    _run([IP, "-n", netns, "link", "set", peer, "name", "eth0"])
    _run([IP, "-n", netns, "addr", "add", f"{address}/{prefix}", "dev", "eth0"])
    _run([IP, "-n", netns, "link", "set", "eth0", "up"])
    _run([IP, "-n", netns, "route", "add", "default", "via", gateway])
    _run([IP, "link", "set", veth, "master", bridge])
    _run([IP, "link", "set", veth, "up"])


def shape(netns: str, veth: str, mbit: float) -> None:
    """``tbf`` at ``mbit`` Mb/s on both ends of a node's link (each direction)."""
    rate = f"{mbit * 1000:.0f}kbit"
    # The bucket holds about 4 ms at the rate (at least 32 KiB, so one segment of a GSO'd
    # write passes); packets wait up to 100 ms before being dropped.
    burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))
    for prefix, dev in (([IP, "netns", "exec", netns], "eth0"), ([], veth)):
        _run([*prefix, TC, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
              "burst", str(burst), "latency", "100ms"])


def shaped_mbit(netns: str) -> float | None:
    """The tbf rate on ``eth0`` in ``netns`` (Mb/s), ``None`` when unshaped."""
    out = _run([IP, "netns", "exec", netns, TC, "qdisc", "show", "dev", "eth0"],
               check=False).stdout
    words = out.split()
    if "tbf" not in words or "rate" not in words:
        return None
    rate = words[words.index("rate") + 1]
    for suffix, scale in (("Gbit", 1e3), ("Mbit", 1.0), ("Kbit", 1e-3), ("bit", 1e-6)):
        if rate.endswith(suffix):
            return float(rate[:-len(suffix)]) * scale
    return None


def link_up(netns: str) -> bool:
    """Whether the node's link (``eth0`` in ``netns``) is administratively up (a link cut,
    ``ip link set eth0 down``, makes it ``False``)."""
    out = _run([IP, "-n", netns, "-o", "link", "show", "dev", "eth0"], check=False).stdout
    flags = out.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in out else []
    return "UP" in flags


def delete_link(name: str) -> None:
    """Delete a root-namespace link (a veth's peer goes with it); absent is fine."""
    if link_exists(name):
        _run([IP, "link", "del", name])


def delete_netns(name: str) -> None:
    if netns_exists(name):
        _run([IP, "netns", "del", name])


def exec_argv(netns: str | None, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``netns`` (as is for ``None``: a real host)."""
    return [IP, "netns", "exec", netns, *argv] if netns else list(argv)
