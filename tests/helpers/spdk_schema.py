"""SPDK's published JSON-RPC parameter schemas for every method kvtool calls.

Transcribed from ``schema/schema.yaml`` of spdk/spdk at commit
01c847295f80fa498110e9121af461a6ccaea9e5 (the 26.09-pre development line; the PyPI
client used is ``spdk`` 26.9). Two methods are not in the part of the file that was read and
come from SPDK's python/spdk/rpc (source tree 3230130e): ``bdev_uring_create``/``_delete``.
``spdk_get_version`` takes no parameters (SPDK's ``rpc_spdk_get_version``).

SPDK's decoder is strict (lib/json/json_util.c): an unknown key, a missing required key or a
wrong type fails the call with -32602 "Invalid parameters". :func:`validate` applies exactly
those rules, so the test peer rejects any request a real ``spdk_tgt`` would reject.

``LEGACY`` lists parameters that older targets accept and this schema no longer has:
``io_unit_size`` (and ``num_shared_buffers``/``buf_cache_size``) of ``nvmf_create_transport``
were removed in SPDK 26.01; a peer playing SPDK 25.x accepts them.
"""

from __future__ import annotations

import re
from typing import Any

SOURCE = "spdk/spdk schema/schema.yaml @ 01c847295f80fa498110e9121af461a6ccaea9e5"

S, B, U8, U16, U32, U64, I32 = "string", "boolean", "uint8", "uint16", "uint32", "uint64", "int32"
UUID, OBJ, ENUM, MASK = "uuid", "object", "enum", "bitmask"

# name -> (type, required, class-for-objects/enums)
Param = tuple[str, bool, str | None]


def p(t: str, req: bool = False, cls: str | None = None) -> Param:
    return (t, req, cls)


OBJECTS: dict[str, dict[str, Param]] = {
    "nvmf_listen_address": {"trtype": p(S, True), "adrfam": p(S), "traddr": p(S, True),
                            "trsvcid": p(S)},
    "nvmf_namespace": {"nsid": p(U32), "bdev_name": p(S, True), "nguid": p(S), "eui64": p(S),
                       "uuid": p(UUID), "ptpl_file": p(S), "anagrpid": p(U32),
                       "no_auto_visible": p(B)},
    "bdev_nvme_multipath_opts": {"policy": p(ENUM), "selector": p(ENUM), "min_io": p(U32)},
}

ENUMS: dict[str, tuple[str, ...]] = {
    "nvme_ana_state": ("optimized", "non_optimized", "inaccessible"),
    "bdev_nvme_multipath_mode": ("failover", "multipath", "disable"),
}

TGT = {"tgt_name": p(S)}

METHODS: dict[str, dict[str, Param]] = {
    "spdk_get_version": {},
    "rpc_get_methods": {"current": p(B), "include_aliases": p(B)},
    "framework_get_subsystems": {},
    "framework_get_config": {"name": p(S, True), "with_batches": p(B)},
    "bdev_get_bdevs": {"name": p(S), "timeout": p(U64)},
    "bdev_malloc_create": {"name": p(S), "block_size": p(U32, True), "num_blocks": p(U64, True),
                           "uuid": p(UUID), "optimal_io_boundary": p(U32), "md_size": p(U32),
                           "md_interleave": p(B), "dif_type": p(I32), "dif_is_head_of_md": p(B),
                           "physical_block_size": p(U32), "dif_pi_format": p(U32),
                           "numa_id": p(I32)},
    "bdev_malloc_delete": {"name": p(S, True)},
    "bdev_aio_create": {"name": p(S, True), "filename": p(S, True), "block_size": p(U32),
                        "readonly": p(B), "fallocate": p(B), "uuid": p(UUID), "nowait": p(B)},
    "bdev_aio_delete": {"name": p(S, True)},
    "bdev_uring_create": {"filename": p(S, True), "name": p(S, True), "block_size": p(U32),
                          "uuid": p(UUID)},
    "bdev_uring_delete": {"name": p(S, True)},
    "bdev_nvme_attach_controller": {
        "name": p(S, True), "trtype": p(S, True), "traddr": p(S, True), "adrfam": p(S),
        "trsvcid": p(S), "priority": p(S), "subnqn": p(S), "hostnqn": p(S), "hostaddr": p(S),
        "hostsvcid": p(S), "prchk_reftag": p(B), "prchk_guard": p(B), "hdgst": p(B),
        "ddgst": p(B), "fabrics_connect_timeout_us": p(U64),
        "multipath": p(ENUM, False, "bdev_nvme_multipath_mode"), "num_io_queues": p(U32),
        "ctrlr_loss_timeout_sec": p(I32), "reconnect_delay_sec": p(U32),
        "fast_io_fail_timeout_sec": p(U32), "psk": p(S), "max_bdevs": p(U32),
        "dhchap_key": p(S), "dhchap_ctrlr_key": p(S), "allow_unrecognized_csi": p(B),
        "multipath_opts": p(OBJ, False, "bdev_nvme_multipath_opts"),
        "disable_sq_flow_control": p(B)},
    "bdev_nvme_get_controllers": {"name": p(S)},
    "bdev_nvme_detach_controller": {"name": p(S, True), "trtype": p(S), "traddr": p(S),
                                    "adrfam": p(S), "trsvcid": p(S), "subnqn": p(S),
                                    "hostaddr": p(S), "hostsvcid": p(S)},
    "nvmf_create_transport": {
        "trtype": p(S, True), **TGT, "max_queue_depth": p(U16), "max_io_qpairs_per_ctrlr": p(U16),
        "in_capsule_data_size": p(U32), "max_io_size": p(U32), "max_aq_depth": p(U32),
        "iobuf_small_cache_size": p(U32), "iobuf_large_cache_size": p(U32), "zcopy": p(B),
        "num_cqe": p(I32), "max_srq_depth": p(U32), "max_sgl_entries": p(U32), "no_srq": p(B),
        "c2h_success": p(B), "dif_insert_or_strip": p(B), "sock_priority": p(U32),
        "acceptor_backlog": p(I32), "abort_timeout_sec": p(U32), "no_wr_batching": p(B),
        "control_msg_num": p(U16), "disable_mappable_bar0": p(B), "disable_adaptive_irq": p(B),
        "disable_shadow_doorbells": p(B), "acceptor_poll_rate": p(U32), "ack_timeout": p(U32),
        "data_wr_pool_size": p(U32), "disable_command_passthru": p(B), "kas": p(U16),
        "min_kato": p(U32), "masked_oncs": p(MASK), "masked_fuses": p(MASK)},
    "nvmf_get_transports": {**TGT, "trtype": p(S)},
    "nvmf_get_subsystems": {"nqn": p(S), **TGT},
    "nvmf_create_subsystem": {
        "nqn": p(S, True), **TGT, "serial_number": p(S), "model_number": p(S),
        "admin_label": p(S), "max_namespaces": p(U32), "allow_any_host": p(B),
        "ana_reporting": p(B), "min_cntlid": p(U16), "max_cntlid": p(U16), "dmrsl": p(U32),
        "wzsl": p(U8), "passthrough": p(B), "enable_nssr": p(B)},
    "nvmf_delete_subsystem": {"nqn": p(S, True), **TGT},
    "nvmf_subsystem_add_listener": {
        "nqn": p(S, True), **TGT, "listen_address": p(OBJ, True, "nvmf_listen_address"),
        "secure_channel": p(B), "ana_state": p(ENUM, False, "nvme_ana_state"),
        "sock_impl": p(S), "numa_id": p(I32)},
    "nvmf_subsystem_remove_listener": {
        "nqn": p(S, True), **TGT, "listen_address": p(OBJ, True, "nvmf_listen_address")},
    "nvmf_subsystem_add_ns": {"nqn": p(S, True),
                              "namespace": p(OBJ, True, "nvmf_namespace"), **TGT},
    "nvmf_subsystem_remove_ns": {"nqn": p(S, True), "nsid": p(U32, True), **TGT},
    "nvmf_subsystem_add_host": {"nqn": p(S, True), "host": p(S, True), **TGT, "psk": p(S),
                                "dhchap_key": p(S), "dhchap_ctrlr_key": p(S)},
    "nvmf_subsystem_remove_host": {"nqn": p(S, True), "host": p(S, True), **TGT,
                                   "timeout_ms": p(U64)},
    "nvmf_subsystem_allow_any_host": {"nqn": p(S, True), "allow_any_host": p(B, True), **TGT},
}

LEGACY: dict[str, dict[str, Param]] = {
    "nvmf_create_transport": {"io_unit_size": p(U32), "num_shared_buffers": p(U32),
                              "buf_cache_size": p(U32)},
}

_RANGES = {U8: (0, 0xFF), U16: (0, 0xFFFF), U32: (0, 0xFFFFFFFF), U64: (0, 2**64 - 1),
           I32: (-(2**31), 2**31 - 1)}
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def _check(value: Any, param: Param, where: str) -> str | None:
    t, _, cls = param
    if t in (S, UUID, ENUM):
        if not isinstance(value, str):
            return f"{where}: expected a string"
        if t == UUID and not _UUID.match(value):
            return f"{where}: not a UUID"
        if t == ENUM and cls in ENUMS and value not in ENUMS[cls]:
            return f"{where}: not one of {ENUMS[cls]}"
        return None
    if t == B:
        return None if isinstance(value, bool) else f"{where}: expected a boolean"
    if t in _RANGES:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{where}: expected an integer"
        lo, hi = _RANGES[t]
        return None if lo <= value <= hi else f"{where}: out of range for {t}"
    if t == OBJ:
        if not isinstance(value, dict):
            return f"{where}: expected an object"
        return _validate_fields(value, OBJECTS[cls or ""], where)
    if t == MASK:
        return None if isinstance(value, (list, str, int)) else f"{where}: bad bitmask"
    return f"{where}: unknown type {t}"


def _validate_fields(params: dict[str, Any], schema: dict[str, Param], where: str) -> str | None:
    for key, value in params.items():
        if key not in schema:
            return f"{where}: Decoder not found for key '{key}'"
        err = _check(value, schema[key], f"{where}.{key}")
        if err:
            return err
    for key, (_, required, _) in schema.items():
        if required and key not in params:
            return f"{where}: missing required key '{key}'"
    return None


def validate(method: str, params: Any, *, legacy: bool = False) -> str | None:
    """None when SPDK would accept ``params`` for ``method``; else the reason it would not."""
    if method not in METHODS:
        return f"Method not found: {method}"
    schema = dict(METHODS[method])
    if legacy:
        schema.update(LEGACY.get(method, {}))
    if params is None:
        params = {}
    if not isinstance(params, dict):
        return "params must be an object"
    return _validate_fields(params, schema, method)
