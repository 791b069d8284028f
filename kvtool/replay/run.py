"""``kvtool replay`` as a library call: typed settings in, the report document out.

::

    from kvtool.replay.run import ReplaySettings, prepare
    job = prepare(ReplaySettings("trace.jsonl"))        # data mode, default tiers
    print(job.setup)                                     # what it chose (sizes, URL, model)
    doc = job.run()                                      # schema kvtool.replay/2

Two modes (docs/replay.md):

* **data** (default): every tier holds real bytes — the CPU "GPU" pool, a DRAM pool and an
  NVMe tier on kvtool's object store (:mod:`kvtool.replay.data`). Without tier options it
  uses the default profile (:data:`DEFAULT_PROFILE`) and puts the NVMe tier on the running
  built-in target (``kvtool target up``), else on a store file in the cache directory;
* **simulate** (``--simulate``): the replayer only, for what-ifs no machine holds.

The work is split by job: :mod:`~kvtool.replay.settings` (the typed settings and their
checks), :mod:`~kvtool.replay.prepare` (trace, configurations, data mode's places and
capacities), :mod:`~kvtool.replay.places` (finding the default NVMe place: the running
target), :mod:`~kvtool.replay.media` (opening or creating it, disk and memory checks),
:mod:`~kvtool.replay.tierfactory` (data tiers), :mod:`~kvtool.replay.job` (the run) and
:mod:`~kvtool.replay.report` (the document). This module is their public face.
"""

from __future__ import annotations

from kvtool.replay.job import ReplayJob
from kvtool.replay.media import mem_available, nvme_engine
from kvtool.replay.places import cache_dir, default_nvme_place
from kvtool.replay.prepare import prepare
from kvtool.replay.report import DATA_FIELDS, describe_setup, timing_off
from kvtool.replay.settings import (
    DEFAULT_MODEL,
    DEFAULT_NVME_FILE_BYTES,
    DEFAULT_PROFILE,
    MEMORY_SHARE,
    SCHEMA,
    ReplaySettings,
)
from kvtool.replay.tierfactory import MediaCounter, open_tiers

__all__ = [
    "DATA_FIELDS",
    "DEFAULT_MODEL",
    "DEFAULT_NVME_FILE_BYTES",
    "DEFAULT_PROFILE",
    "MEMORY_SHARE",
    "SCHEMA",
    "MediaCounter",
    "ReplayJob",
    "ReplaySettings",
    "cache_dir",
    "default_nvme_place",
    "describe_setup",
    "mem_available",
    "nvme_engine",
    "open_tiers",
    "prepare",
    "timing_off",
]
