"""A :class:`~kvtool.target.config.TargetConfig` as the document
:func:`kvtool.target.loader.parse_config` reads back to an equal config (the resolved config
kept in the state record, the QEMU guest's config, ``target export --format kvtool``)."""

from __future__ import annotations

from typing import Any

from kvtool.target.config import TargetConfig


def config_document(cfg: TargetConfig) -> dict[str, Any]:
    """``cfg`` as a document :func:`parse_config` reads back to an equal config."""
    doc: dict[str, Any] = {"backend": cfg.backend, "name": cfg.name}
    if cfg.backend == "emulator":
        doc["emulator"] = {"runtime": cfg.runtime}
        if cfg.metrics_port is not None:
            doc["emulator"]["metrics_port"] = cfg.metrics_port
        if cfg.busy_poll_us is not None:
            doc["emulator"]["busy_poll_us"] = cfg.busy_poll_us
    if cfg.nvmet_root:
        doc["nvmet"] = {"configfs_root": cfg.nvmet_root}
    if cfg.spdk_socket:
        doc["spdk"] = {"socket": cfg.spdk_socket, "timeout": int(cfg.spdk_timeout)}
    if cfg.spdk_start:
        doc.setdefault("spdk", {"timeout": int(cfg.spdk_timeout)})
        doc["spdk"].update(_strip({"start": True, "mem_mb": cfg.spdk_mem_mb,
                                   "cpumask": cfg.spdk_cpumask,
                                   "pci_driver": cfg.spdk_pci_driver}))
    if cfg.hosts:
        doc["host"] = [_strip({"nqn": h.nqn, "dhchap_key_file": h.dhchap_key_file,
                               "dhchap_ctrl_key_file": h.dhchap_ctrl_key_file,
                               "dhchap_hashes": list(h.dhchap_hashes) or None,
                               "dhchap_dhgroups": list(h.dhchap_dhgroups) or None})
                       for h in cfg.hosts]
    if cfg.transports:
        doc["transport"] = [_strip({"type": t.type, "io_unit_size": t.io_unit_size,
                                    "in_capsule_data_size": t.in_capsule_data_size,
                                    "max_io_size": t.max_io_size,
                                    "max_queue_depth": t.max_queue_depth,
                                    "max_io_qpairs_per_ctrlr": t.max_io_qpairs_per_ctrlr})
                            for t in cfg.transports]
    subs = []
    for s in cfg.subsystems:
        namespaces = []
        for n in s.namespaces:
            ns = _strip({"nsid": n.nsid, "backing": n.backing, "path": n.path, "size": n.size,
                         "lba": n.lba, "bdev_name": n.bdev_name, "uuid": n.uuid, "nguid": n.nguid})
            if n.create:
                ns["create"] = True
            if n.buffered_io:
                ns["buffered_io"] = True
            if n.bdev_module != "aio":
                ns["bdev"] = n.bdev_module
            if n.ana_group is not None:
                ns["ana_group"] = n.ana_group
            if n.nvme is not None:
                ns["nvme"] = _strip({"trtype": n.nvme.trtype, "traddr": n.nvme.traddr,
                                     "adrfam": n.nvme.adrfam, "trsvcid": n.nvme.trsvcid,
                                     "subnqn": n.nvme.subnqn, "namespace": n.nvme.namespace})
            namespaces.append(ns)
        sub = _strip({"nqn": s.nqn, "serial": s.serial, "model": s.model,
                      "max_namespaces": s.max_namespaces})
        if s.hosts:
            sub["hosts"] = list(s.hosts)
        if s.allow_any_host:
            sub["allow_any_host"] = True
        if namespaces:
            sub["namespace"] = namespaces
        subs.append(sub)
    doc["subsystem"] = subs
    doc["listener"] = [_strip({"id": lst.id, "transport": lst.transport, "address": lst.address,
                               "port": lst.port, "subsystems": list(lst.subsystems),
                               "inline_data_size": lst.inline_data_size,
                               "ana": {str(g): s for g, s in lst.ana} or None})
                       for lst in cfg.listeners]
    return doc


def _strip(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
