"""The layer table of kvtool/ and emulator/ (docs/architecture.md, "Layers"): enforced by
tests/test_import_cycles.py, and drawn by the doc (tests/test_architecture_doc.py checks the
two agree)."""

from __future__ import annotations

# The layer table, bottom first. A unit is a package or module (a module belongs to the
# unit with the longest matching name); it may import itself and units of lower layers,
# never a unit of its own layer or of a higher one. docs/architecture.md draws this table.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvtool", "kvtool.errors", "kvtool.lazy", "kvtool.gcpause", "kvtool.collapse", "emulator"),
    ("kvtool.units", "kvtool.metrics", "kvtool.plotting", "kvtool.jsondoc", "kvtool.fanout"),
    ("kvtool.configfile",),
    ("kvtool.geometry", "kvtool.trace", "kvtool.store.io", "kvtool.serving.kvpool"),
    ("kvtool.align", "kvtool.nvme", "kvtool.cache"),
    ("kvtool.store", "kvtool.plan", "kvtool.serving", "emulator.nvmetcp"),
    ("emulator.qemu",),
    ("kvtool.target",),
    ("kvtool.mooncake", "emulator.spdk"),
    ("kvtool.tiers",),
    ("kvtool.cluster",),
    ("kvtool.replay",),
    ("kvtool.integrations",),
    ("kvtool.experiments",),
    ("kvtool.cli",),
    ("kvtool.__main__",),
)
