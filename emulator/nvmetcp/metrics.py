"""Prometheus metrics of the userspace NVMe/TCP target (``--metrics-port``).

Counted at the PDU boundary of each connection (commands in, completions and data out),
so the command handlers stay free of bookkeeping::

    kvtool_nvmetcp_commands_total{queue,opcode}    capsules received (queue admin / io)
    kvtool_nvmetcp_bytes_total{direction}          data of read / write commands (SGL length)
    kvtool_nvmetcp_errors_total{sct,sc}            completions with a non-zero status
    kvtool_nvmetcp_terminations_total              connections ended with a C2HTermReq
    kvtool_nvmetcp_connections                     queue connections open now
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from emulator.nvmetcp.connection import QueueConnection
from kvtool.nvme import pdu as P
from kvtool.nvme import spec

_IO_NAMES = {spec.IO_FLUSH: "flush", spec.IO_WRITE: "write", spec.IO_READ: "read"}


class TargetMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.commands = Counter("kvtool_nvmetcp_commands", "NVMe commands received",
                                ["queue", "opcode"], registry=r)
        self.bytes = Counter("kvtool_nvmetcp_bytes", "Data of I/O commands",
                             ["direction"], registry=r)
        self.errors = Counter("kvtool_nvmetcp_errors", "Completions with an error status",
                              ["sct", "sc"], registry=r)
        self.terminations = Counter("kvtool_nvmetcp_terminations",
                                    "Connections terminated with a C2HTermReq", registry=r)
        self.connections = Gauge("kvtool_nvmetcp_connections", "Open queue connections",
                                 registry=r)

    def connection_class(self) -> type[QueueConnection]:
        """A :class:`QueueConnection` that counts into these metrics."""
        metrics = self

        class MeteredConnection(QueueConnection):
            hot_path = False  # every command goes through _dispatch and _write, counted

            def connection_made(self, transport: Any) -> None:
                metrics.connections.inc()
                super().connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                metrics.connections.dec()
                super().connection_lost(exc)

            def _dispatch(self, pdu: P.Pdu, digest_ok: bool) -> None:
                if isinstance(pdu, P.CapsuleCmd):
                    sqe = pdu.sqe
                    if getattr(self, "qid", 0) > 0:
                        name = _IO_NAMES.get(sqe.opcode, f"{sqe.opcode:#04x}")
                        metrics.commands.labels("io", name).inc()
                        if sqe.opcode in (spec.IO_READ, spec.IO_WRITE):
                            metrics.bytes.labels(name).inc(sqe.sgl.length)
                    else:
                        metrics.commands.labels("admin", f"{sqe.opcode:#04x}").inc()
                super()._dispatch(pdu, digest_ok)

            def _write(self, pdu: P.Pdu) -> None:
                if isinstance(pdu, P.CapsuleResp) and pdu.cqe.status & 0xFFFE:
                    st = pdu.cqe.status
                    metrics.errors.labels(f"{(st >> 9) & 7:#x}", f"{(st >> 1) & 0xFF:#04x}").inc()
                super()._write(pdu)

            def _terminate(self, fes: int, fei: int, message: str) -> None:
                metrics.terminations.inc()
                super()._terminate(fes, fei, message)

        return MeteredConnection
