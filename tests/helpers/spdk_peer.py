"""A JSON-RPC peer on a real Unix socket that answers like ``spdk_tgt``'s NVMe-oF RPCs.

It is the other end of the wire for kvtool's SPDK backend, which talks to it through the
PyPI ``spdk`` client exactly as it would talk to ``spdk_tgt``. Every request is first
checked against SPDK's published schema (:mod:`tests.helpers.spdk_schema`): an unknown
method is -32601, unknown/missing/mistyped parameters are -32602, as SPDK's strict decoder
does. Accepted requests then act on a model of the target's state with SPDK's documented
semantics (duplicate transport → -32603 "already exists", duplicate listener/host → -32602,
a namespace needs an existing bdev, removing a missing object fails...), so a plan that
would fail on a real target fails here.

``fail_next(method, code, message)`` makes the next call of ``method`` fail, to inject a
failure half-way through a plan.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import threading
from typing import Any

from tests.helpers import spdk_schema

INVALID_PARAMS = -32602
INTERNAL = -32603
NOT_FOUND = -32601


class RpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message


class SpdkPeer:
    def __init__(self, path: str, *, version: tuple[int, int] = (26, 9)) -> None:
        self.path = path
        self.version = version
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.rejected: list[tuple[str, str]] = []
        self.transports: dict[str, dict[str, Any]] = {}
        self.bdevs: dict[str, dict[str, Any]] = {}
        self.controllers: dict[str, dict[str, Any]] = {}
        self.subsystems: dict[str, dict[str, Any]] = {
            "nqn.2014-08.org.nvmexpress.discovery": {
                "nqn": "nqn.2014-08.org.nvmexpress.discovery", "subtype": "Discovery",
                "listen_addresses": [], "allow_any_host": True, "hosts": []}}
        self._fail: list[tuple[str, int, str]] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ server loop
    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
            wake.connect(self.path)  # unblocks accept()
        self._thread.join(timeout=5)
        self._sock.close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self._stop.is_set():
                conn.close()
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        buf = ""
        decoder = json.JSONDecoder()
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data.decode()
                while buf.strip():
                    buf = buf.lstrip()
                    try:
                        req, end = decoder.raw_decode(buf)
                    except json.JSONDecodeError:
                        break
                    buf = buf[end:]
                    conn.sendall(json.dumps(self._dispatch(req)).encode())

    def _dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        rid = req.get("id")
        method = req.get("method", "")
        params = req.get("params", {})
        self.requests.append((method, copy.deepcopy(params)))
        legacy = self.version[0] < 26
        problem = spdk_schema.validate(method, params, legacy=legacy)
        if problem is not None:
            self.rejected.append((method, problem))
            code = NOT_FOUND if problem.startswith("Method not found") else INVALID_PARAMS
            return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": problem}}
        try:
            for i, (m, code, message) in enumerate(self._fail):
                if m == method:
                    del self._fail[i]
                    raise RpcError(code, message)
            result = getattr(self, "rpc_" + method)(**params)
        except RpcError as exc:
            return {"jsonrpc": "2.0", "id": rid, "error": {"code": exc.code, "message": exc.message}}
        return {"jsonrpc": "2.0", "id": rid, "result": result}

    def fail_next(self, method: str, code: int = INTERNAL, message: str = "injected failure") -> None:
        self._fail.append((method, code, message))

    # ------------------------------------------------------------ state helpers
    def _sub(self, nqn: str) -> dict[str, Any]:
        if nqn not in self.subsystems:
            raise RpcError(INVALID_PARAMS, f"Unable to find subsystem with NQN {nqn}")
        return self.subsystems[nqn]

    def _new_bdev(self, name: str, block_size: int, num_blocks: int, product: str,
                  spec: dict[str, Any]) -> str:
        if name in self.bdevs:
            raise RpcError(INVALID_PARAMS, f"Bdev name {name} already exists")
        self.bdevs[name] = {"name": name, "block_size": block_size, "num_blocks": num_blocks,
                            "product_name": product, "driver_specific": spec, "claimed": False}
        return name

    def _drop_bdev(self, name: str) -> None:
        if name not in self.bdevs:
            raise RpcError(-19, "No such device")
        del self.bdevs[name]
        for sub in self.subsystems.values():  # hot remove, as SPDK does
            if "namespaces" in sub:
                sub["namespaces"] = [n for n in sub["namespaces"] if n["bdev_name"] != name]

    # ------------------------------------------------------------ methods
    def rpc_spdk_get_version(self) -> dict[str, Any]:
        major, minor = self.version
        return {"version": f"SPDK v{major}.{minor:02d}", "fields": {
            "major": major, "minor": minor, "patch": 0, "suffix": ""}}

    def rpc_nvmf_get_transports(self, trtype: str | None = None, tgt_name: str | None = None) -> Any:
        return [copy.deepcopy(t) for k, t in self.transports.items() if trtype in (None, k)]

    def rpc_nvmf_create_transport(self, trtype: str, **opts: Any) -> bool:
        key = trtype.upper()
        if key in self.transports:
            raise RpcError(INTERNAL, f"Transport type '{key}' already exists")
        t = {"trtype": key, "max_queue_depth": 128, "max_io_qpairs_per_ctrlr": 127,
             "in_capsule_data_size": 4096, "max_io_size": 131072, "max_aq_depth": 128}
        if self.version[0] < 26:
            t["io_unit_size"] = 131072
        t.update({k: v for k, v in opts.items() if k != "tgt_name"})
        self.transports[key] = t
        return True

    def rpc_bdev_get_bdevs(self, name: str | None = None, timeout: int | None = None) -> Any:
        if name is not None and name not in self.bdevs:
            raise RpcError(-19, "No such device")
        return [{k: v for k, v in b.items() if k != "claimed"} for n, b in self.bdevs.items()
                if name in (None, n)]

    def rpc_bdev_malloc_create(self, block_size: int, num_blocks: int, name: str | None = None,
                               **opts: Any) -> str:
        if block_size % 512:
            raise RpcError(INVALID_PARAMS, "block_size must be a multiple of 512")
        return self._new_bdev(name or f"Malloc{len(self.bdevs)}", block_size, num_blocks,
                              "Malloc disk", {})

    def rpc_bdev_malloc_delete(self, name: str) -> bool:
        self._drop_bdev(name)
        return True

    def _file_bdev(self, module: str, name: str, filename: str, block_size: int | None) -> str:
        if not os.path.exists(filename):
            raise RpcError(INVALID_PARAMS, f"Could not open {filename}: No such file or directory")
        bs = block_size or 512
        return self._new_bdev(name, bs, os.path.getsize(filename) // bs,
                              f"{module.upper()} disk", {module: {"filename": filename}})

    def rpc_bdev_aio_create(self, name: str, filename: str, block_size: int | None = None,
                            **opts: Any) -> str:
        return self._file_bdev("aio", name, filename, block_size)

    def rpc_bdev_aio_delete(self, name: str) -> bool:
        self._drop_bdev(name)
        return True

    def rpc_bdev_uring_create(self, name: str, filename: str, block_size: int | None = None,
                              **opts: Any) -> str:
        return self._file_bdev("uring", name, filename, block_size)

    def rpc_bdev_uring_delete(self, name: str) -> bool:
        self._drop_bdev(name)
        return True

    def rpc_bdev_nvme_get_controllers(self, name: str | None = None) -> Any:
        return [copy.deepcopy(c) for n, c in self.controllers.items() if name in (None, n)]

    def rpc_bdev_nvme_attach_controller(self, name: str, trtype: str, traddr: str, **opts: Any) -> Any:
        if name in self.controllers:
            raise RpcError(-17, "File exists")
        trid = {"trtype": trtype, "traddr": traddr, **{k: v for k, v in opts.items()
                                                       if k in ("adrfam", "trsvcid", "subnqn")}}
        self.controllers[name] = {"name": name, "ctrlrs": [{"trid": trid}]}
        # a 7.68 TB drive formatted with 4 KiB LBAs
        bdev = self._new_bdev(f"{name}n1", 4096, 7_680_000_000_000 // 4096, "NVMe disk",
                              {"nvme": [{"trid": trid}]})
        return [bdev]

    def rpc_bdev_nvme_detach_controller(self, name: str, **opts: Any) -> bool:
        if name not in self.controllers:
            raise RpcError(-19, "No such device")
        del self.controllers[name]
        for b in [b for b in self.bdevs if b.startswith(f"{name}n")]:
            self._drop_bdev(b)
        return True

    def rpc_nvmf_get_subsystems(self, nqn: str | None = None, tgt_name: str | None = None) -> Any:
        return [copy.deepcopy(s) for n, s in self.subsystems.items() if nqn in (None, n)]

    def rpc_nvmf_create_subsystem(self, nqn: str, tgt_name: str | None = None, **opts: Any) -> bool:
        if nqn in self.subsystems:
            raise RpcError(INTERNAL, f"Unable to create subsystem {nqn}")
        self.subsystems[nqn] = {
            "nqn": nqn, "subtype": "NVMe", "listen_addresses": [],
            "allow_any_host": bool(opts.get("allow_any_host", False)), "hosts": [],
            "serial_number": opts.get("serial_number", "00000000000000000000"),
            "model_number": opts.get("model_number", "SPDK bdev Controller"),
            "max_namespaces": opts.get("max_namespaces", 32), "namespaces": []}
        return True

    def rpc_nvmf_delete_subsystem(self, nqn: str, tgt_name: str | None = None) -> bool:
        self._sub(nqn)
        del self.subsystems[nqn]
        return True

    def rpc_nvmf_subsystem_add_ns(self, nqn: str, namespace: dict[str, Any],
                                  tgt_name: str | None = None) -> int:
        sub = self._sub(nqn)
        bdev = namespace["bdev_name"]
        if bdev not in self.bdevs:
            raise RpcError(INVALID_PARAMS, f"Unable to add namespace: bdev {bdev} not found")
        used = {n["nsid"] for n in sub["namespaces"]}
        nsid = namespace.get("nsid") or next(i for i in range(1, 10**6) if i not in used)
        if nsid in used or nsid > sub["max_namespaces"]:
            raise RpcError(INVALID_PARAMS, "Invalid parameters")
        if any(n["bdev_name"] == bdev for s in self.subsystems.values()
               for n in s.get("namespaces", [])):
            raise RpcError(INVALID_PARAMS, f"bdev {bdev} is already claimed")
        sub["namespaces"].append({"nsid": nsid, "bdev_name": bdev, "name": bdev,
                                  **({"uuid": namespace["uuid"]} if "uuid" in namespace else {})})
        sub["namespaces"].sort(key=lambda n: n["nsid"])
        return nsid

    def rpc_nvmf_subsystem_remove_ns(self, nqn: str, nsid: int, tgt_name: str | None = None) -> bool:
        sub = self._sub(nqn)
        if not any(n["nsid"] == nsid for n in sub["namespaces"]):
            raise RpcError(INVALID_PARAMS, "Invalid parameters")
        sub["namespaces"] = [n for n in sub["namespaces"] if n["nsid"] != nsid]
        return True

    def rpc_nvmf_subsystem_add_host(self, nqn: str, host: str, **opts: Any) -> bool:
        sub = self._sub(nqn)
        if any(h["nqn"] == host for h in sub["hosts"]):
            raise RpcError(INVALID_PARAMS, "Invalid parameters")
        sub["hosts"].append({"nqn": host})
        return True

    def rpc_nvmf_subsystem_remove_host(self, nqn: str, host: str, **opts: Any) -> bool:
        sub = self._sub(nqn)
        if not any(h["nqn"] == host for h in sub["hosts"]):
            raise RpcError(INVALID_PARAMS, "Invalid parameters")
        sub["hosts"] = [h for h in sub["hosts"] if h["nqn"] != host]
        return True

    def rpc_nvmf_subsystem_allow_any_host(self, nqn: str, allow_any_host: bool,
                                          tgt_name: str | None = None) -> bool:
        self._sub(nqn)["allow_any_host"] = allow_any_host
        return True

    @staticmethod
    def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return (a["trtype"].upper() == b["trtype"].upper() and a["traddr"] == b["traddr"]
                and str(a.get("trsvcid")) == str(b.get("trsvcid")))

    def rpc_nvmf_subsystem_add_listener(self, nqn: str, listen_address: dict[str, Any],
                                        **opts: Any) -> bool:
        sub = self._sub(nqn)
        if listen_address["trtype"].upper() not in self.transports:
            raise RpcError(INVALID_PARAMS, "Unable to find transport")
        if any(self._same(a, listen_address) for a in sub["listen_addresses"]):
            raise RpcError(INVALID_PARAMS, "Listener already exists")
        sub["listen_addresses"].append({"trtype": listen_address["trtype"].upper(),
                                        "adrfam": listen_address.get("adrfam", "IPv4"),
                                        "traddr": listen_address["traddr"],
                                        "trsvcid": listen_address.get("trsvcid", "")})
        return True

    def rpc_nvmf_subsystem_remove_listener(self, nqn: str, listen_address: dict[str, Any],
                                           **opts: Any) -> bool:
        sub = self._sub(nqn)
        if not any(self._same(a, listen_address) for a in sub["listen_addresses"]):
            raise RpcError(INVALID_PARAMS, "Invalid parameters")
        sub["listen_addresses"] = [a for a in sub["listen_addresses"]
                                   if not self._same(a, listen_address)]
        return True

    def rpc_framework_get_config(self, name: str, with_batches: bool | None = None) -> Any:
        if with_batches is not None and self.version < (26, 5):
            raise RpcError(INVALID_PARAMS, "Invalid parameters")
        if name == "bdev":
            out = []
            for b in self.bdevs.values():
                if b["product_name"] == "Malloc disk":
                    out.append({"method": "bdev_malloc_create", "params": {
                        "name": b["name"], "block_size": b["block_size"],
                        "num_blocks": b["num_blocks"]}})
                elif b["product_name"] in ("AIO disk", "URING disk"):
                    mod = b["product_name"].split()[0].lower()
                    out.append({"method": f"bdev_{mod}_create", "params": {
                        "name": b["name"], "filename": b["driver_specific"][mod]["filename"],
                        "block_size": b["block_size"]}})
            for c in self.controllers.values():
                out.append({"method": "bdev_nvme_attach_controller",
                            "params": {"name": c["name"], **c["ctrlrs"][0]["trid"]}})
            return out
        if name == "nvmf":
            out = [{"method": "nvmf_create_transport", "params": t} for t in self.transports.values()]
            for s in self.subsystems.values():
                if s["subtype"] != "NVMe":
                    continue
                out.append({"method": "nvmf_create_subsystem", "params": {
                    "nqn": s["nqn"], "allow_any_host": s["allow_any_host"],
                    "serial_number": s["serial_number"], "model_number": s["model_number"]}})
                for n in s["namespaces"]:
                    out.append({"method": "nvmf_subsystem_add_ns", "params": {
                        "nqn": s["nqn"], "namespace": {"nsid": n["nsid"], "bdev_name": n["bdev_name"]}}})
                for h in s["hosts"]:
                    out.append({"method": "nvmf_subsystem_add_host",
                                "params": {"nqn": s["nqn"], "host": h["nqn"]}})
                for a in s["listen_addresses"]:
                    out.append({"method": "nvmf_subsystem_add_listener",
                                "params": {"nqn": s["nqn"], "listen_address": a}})
            return out
        raise RpcError(INVALID_PARAMS, f"Subsystem {name} not found")

    def state(self) -> dict[str, Any]:
        """Everything the target holds (for before/after comparisons)."""
        return copy.deepcopy({"transports": self.transports, "bdevs": self.bdevs,
                              "controllers": self.controllers, "subsystems": self.subsystems})
