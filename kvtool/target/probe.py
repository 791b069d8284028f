"""Ask a live NVMe/TCP target what it serves (used by the emulator engines' status)."""

from __future__ import annotations

from kvtool.target.model import Host


def probe_namespaces(address: str, port: int, nqn: str, hostnqn: str | None,
                     timeout: float = 5.0, host: Host | None = None) -> dict[int, tuple[int, int]]:
    """Ask a live NVMe/TCP target for each namespace's (bytes, LBA size) via Identify.

    ``host``: the config's [[host]] entry, whose key files authenticate the probe.
    """
    from kvtool.nvme import host as nvme_host
    from kvtool.nvme.dhchap import load_secret_file
    secret = ctrl_secret = None
    if host is not None and host.dhchap_key_file:
        secret = load_secret_file(host.dhchap_key_file, field="dhchap_key_file")
        if host.dhchap_ctrl_key_file:
            ctrl_secret = load_secret_file(host.dhchap_ctrl_key_file,
                                           field="dhchap_ctrl_key_file")
    with nvme_host.connect(address, port, nqn, hostnqn=hostnqn, io_queues=0,
                           timeout=timeout, reconnect=0, dhchap_secret=secret,
                           dhchap_ctrl_secret=ctrl_secret) as ctrl:
        out = {}
        for nsid in ctrl.active_namespaces():
            info = ctrl.identify_namespace(nsid)
            out[nsid] = (info.nsze * info.lba_size, info.lba_size)
        return out
