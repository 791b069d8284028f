"""Ask a live NVMe/TCP target what it serves (used by the emulator runtimes' status)."""

from __future__ import annotations

from typing import Any

from kvtool.target.config import Host, Listener, TargetConfig


def _secrets(host: Host | None) -> tuple[Any, Any]:
    from kvtool.nvme.dhchap import load_secret_file
    secret = ctrl_secret = None
    if host is not None and host.dhchap_key_file:
        secret = load_secret_file(host.dhchap_key_file, field="dhchap_key_file")
        if host.dhchap_ctrl_key_file:
            ctrl_secret = load_secret_file(host.dhchap_ctrl_key_file,
                                           field="dhchap_ctrl_key_file")
    return secret, ctrl_secret


def probe_ana(address: str, port: int, nqn: str, hostnqn: str | None, timeout: float = 5.0,
              host: Host | None = None) -> dict[int, str] | None:
    """The ANA state of each group as this listener reports it ({group: state name});
    None when the controller does not report ANA."""
    from kvtool.nvme import host as nvme_host
    secret, ctrl_secret = _secrets(host)
    with nvme_host.connect(address, port, nqn, hostnqn=hostnqn, io_queues=0,
                           timeout=timeout, reconnect=0, dhchap_secret=secret,
                           dhchap_ctrl_secret=ctrl_secret) as ctrl:
        info = ctrl.info or ctrl.identify_controller()
        if not info.ana:
            return None
        _chg, groups = ctrl.ana_log()
        return {g.grpid: g.state_name for g in groups}


def probe_namespaces(address: str, port: int, nqn: str, hostnqn: str | None,
                     timeout: float = 5.0, host: Host | None = None) -> dict[int, tuple[int, int]]:
    """Ask a live NVMe/TCP target for each namespace's (bytes, LBA size) via Identify.

    ``host``: the config's [[host]] entry, whose key files authenticate the probe.
    """
    from kvtool.nvme import host as nvme_host
    secret, ctrl_secret = _secrets(host)
    with nvme_host.connect(address, port, nqn, hostnqn=hostnqn, io_queues=0,
                           timeout=timeout, reconnect=0, dhchap_secret=secret,
                           dhchap_ctrl_secret=ctrl_secret) as ctrl:
        out = {}
        for nsid in ctrl.active_namespaces():
            info = ctrl.identify_namespace(nsid)
            out[nsid] = (info.nsze * info.lba_size, info.lba_size)
        return out


def listener_ana(cfg: TargetConfig, lst: Listener) -> dict[int, str] | None:
    """:func:`probe_ana` through ``lst`` with the first subsystem it serves and a host the
    config allows; None when nothing answers there or it reports no ANA."""
    sub = next((s for s in cfg.subsystems if s.nqn in lst.subsystems), None)
    if sub is None:
        return None
    hostnqn = None if sub.allow_any_host or not sub.hosts else sub.hosts[0]
    try:
        return probe_ana(lst.address, lst.port, sub.nqn, hostnqn,
                         host=cfg.host(hostnqn) if hostnqn else None)
    except Exception:  # status must not fail because one probe did
        return None
