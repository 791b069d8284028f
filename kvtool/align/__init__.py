"""Alignment arithmetic, padding and bounce-buffer planning, device probing, layout audit.

>>> plan_object(1002240, 512).residue, plan_object(1002240, 512).lbas
(256, 1958)
"""

from typing import TYPE_CHECKING

from kvtool.lazy import exports

if TYPE_CHECKING:
    from kvtool.align.arith import (
        check_alignment,
        is_aligned,
        lbas,
        padded_size,
        residue,
        round_down,
        round_up,
    )
    from kvtool.align.layout import (
        Extent,
        LayoutAudit,
        Misalignment,
        PackedRule,
        audit_extents,
        audit_rule,
        parse_rule,
        read_extents,
    )
    from kvtool.align.plan import PAGE, BouncePlan, ObjectPlan, plan_object
    from kvtool.align.probe import DeviceLimits, probe_device, statx_dioalign

__getattr__, __dir__ = exports(__name__, {
    "BouncePlan": "plan",
    "DeviceLimits": "probe",
    "Extent": "layout",
    "LayoutAudit": "layout",
    "Misalignment": "layout",
    "ObjectPlan": "plan",
    "PAGE": "plan",
    "PackedRule": "layout",
    "audit_extents": "layout",
    "audit_rule": "layout",
    "check_alignment": "arith",
    "is_aligned": "arith",
    "lbas": "arith",
    "padded_size": "arith",
    "parse_rule": "layout",
    "plan_object": "plan",
    "probe_device": "probe",
    "read_extents": "layout",
    "residue": "arith",
    "round_down": "arith",
    "round_up": "arith",
    "statx_dioalign": "probe",
})

__all__ = [
    "PAGE",
    "BouncePlan",
    "DeviceLimits",
    "Extent",
    "LayoutAudit",
    "Misalignment",
    "ObjectPlan",
    "PackedRule",
    "audit_extents",
    "audit_rule",
    "check_alignment",
    "is_aligned",
    "lbas",
    "padded_size",
    "parse_rule",
    "plan_object",
    "probe_device",
    "read_extents",
    "residue",
    "round_down",
    "round_up",
    "statx_dioalign",
]
