"""The alignment audit behind ``kvtool audit``: objects × alignments × placements.

:func:`audit` plans every object size against every LBA size, optionally against a probed
device's real limits, and audits proposed placements. The result's :meth:`AuditReport.to_dict`
is the ``--json`` document (schema ``kvtool.audit/1``, docs/audit.md).

A check **fails** when an object needs padding (its size is not a whole number of LBAs),
a placement has a misaligned, overlapping or out-of-device extent, or the device cannot
do O_DIRECT at all. Physical-block alignment is advice only: it avoids read-modify-write
but the I/O succeeds without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtool.align.arith import check_alignment
from kvtool.align.layout import Extent, LayoutAudit, audit_extents, audit_rule, parse_rule
from kvtool.align.plan import PAGE, ObjectPlan, plan_object
from kvtool.align.probe import DeviceLimits
from kvtool.errors import UsageError, param
from kvtool.geometry import KVGeometry, ObjectSize

SCHEMA = "kvtool.audit/1"
DEFAULT_LBAS = (512, 4096)


@dataclass(frozen=True)
class ObjectCheck:
    """One object kind planned against one LBA size."""

    obj: ObjectSize
    plan: ObjectPlan
    lba_source: str
    physical_block_size: int | None = None
    objects_fit: int | None = None

    @property
    def physical_aligned(self) -> bool | None:
        if self.physical_block_size is None:
            return None
        return self.plan.padded_bytes % self.physical_block_size == 0

    def to_dict(self) -> dict[str, object]:
        return {"object": self.obj.name, "count": self.obj.count,
                "lba_source": self.lba_source, **self.plan.to_dict(),
                "physical_block_size": self.physical_block_size,
                "physical_aligned": self.physical_aligned, "objects_fit": self.objects_fit}


@dataclass(frozen=True)
class PlacementCheck:
    """One placement audited against one LBA size (``object`` names the size a rule used)."""

    audit: LayoutAudit
    object_name: str | None

    def to_dict(self) -> dict[str, object]:
        return {"object": self.object_name, **self.audit.to_dict()}


@dataclass
class AuditReport:
    geometry: KVGeometry | None
    object_layout: str | None
    objects: list[ObjectSize]
    device: DeviceLimits | None
    lbas: list[int]
    mem_align: int
    checks: list[ObjectCheck] = field(default_factory=list)
    layouts: list[PlacementCheck] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, object]:
        return {
            "schema": SCHEMA,
            "geometry": None if self.geometry is None else self.geometry.to_dict(),
            "object_layout": self.object_layout,
            "objects": [{"name": o.name, "bytes": o.nbytes, "count": o.count}
                        for o in self.objects],
            "device": None if self.device is None else self.device.to_dict(),
            "lbas": self.lbas,
            "mem_align": self.mem_align,
            "checks": [c.to_dict() for c in self.checks],
            "layouts": [lay.to_dict() for lay in self.layouts],
            "ok": self.ok,
            "failures": self.failures,
        }


def audit(objects: Sequence[ObjectSize], *, lbas: Sequence[int] | None = None,
          device: DeviceLimits | None = None, mem_align: int | None = None,
          rules: Sequence[str] = (), extent_lists: Sequence[tuple[str, Sequence[Extent]]] = (),
          geometry: KVGeometry | None = None, object_layout: str | None = None) -> AuditReport:
    """Audit ``objects`` against ``lbas`` (default 512 and 4096, or the device's own when a
    device is given and ``lbas`` is not), then the placements ``rules`` (``packed:...``)
    and ``extent_lists`` (``(name, extents)``)."""
    sources: dict[int, str] = {}
    for a in lbas or ():
        sources[check_alignment(a, field="lba")] = "given"
    if device is not None:
        sources.setdefault(device.dio_offset_align, "device")
    if not sources:
        sources = dict.fromkeys(DEFAULT_LBAS, "default")
    mem = mem_align if mem_align is not None else (
        device.dio_mem_align if device is not None else PAGE)
    check_alignment(mem, field="mem_align")
    report = AuditReport(geometry, object_layout, list(objects), device, list(sources), mem)

    if device is not None and not device.dio_supported:
        report.failures.append(f"{device.path}: the filesystem does not support O_DIRECT")
    for obj in objects:
        for lba, src in sources.items():
            plan = plan_object(obj.nbytes, lba, mem)
            fit = None
            if device is not None:
                fit = device.size_bytes // plan.padded_bytes
            phys = device.physical_block_size if device is not None else None
            report.checks.append(ObjectCheck(obj, plan, src, phys, fit))
            if not plan.ok:
                report.failures.append(
                    f"{obj.name} object of {obj.nbytes} B ≡ {plan.residue} (mod {lba}): pad to "
                    f"{plan.padded_bytes} B and bounce")

    size = device.size_bytes if device is not None else None
    for text in rules:
        if _rule_has_size(text):
            targets: list[tuple[str | None, int | None]] = [(None, None)]
        elif objects:
            targets = [(o.name, o.nbytes) for o in objects]
        else:
            raise UsageError("the packed rule needs size=S, or give an object size "
                             f"({param('model')}, {param('block_bytes')} or "
                             f"{param('geometry')})", field="layout")
        for name, nbytes in targets:
            rule = parse_rule(text, default_size=nbytes)
            for lba in sources:
                _add_layout(report, audit_rule(rule, lba=lba, device_size=size), name)
    for name, extents in extent_lists:
        for lba in sources:
            _add_layout(report, audit_extents(extents, lba=lba, mem_align=mem, device_size=size,
                                              source=name), None)
    return report


def _rule_has_size(text: str) -> bool:
    body = text.partition(":")[2]
    return any(item.strip().lower().startswith("size=") for item in body.split(","))


def _add_layout(report: AuditReport, result: LayoutAudit, name: str | None) -> None:
    report.layouts.append(PlacementCheck(result, name))
    where = f"{result.source} ({name})" if name else result.source
    if result.first_misaligned is not None:
        report.failures.append(
            f"{where}: {result.misaligned} of {result.extents} extents misaligned for "
            f"{result.lba}-B LBAs; first: {result.first_misaligned.message}")
    if result.overlap is not None:
        a, b = result.overlap
        report.failures.append(f"{where}: extents {a} and {b} overlap")
    if result.beyond_end is not None:
        report.failures.append(f"{where}: extent {result.beyond_end} ends past the device end "
                               f"({result.device_size} B)")
