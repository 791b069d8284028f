"""kvtool: tools and a reference emulator for KV-cache tiered storage (GPU → DRAM → NVMe/NVMe-oF)."""

from kvtool import compiled as _compiled

__version__ = "0.1.0"

# the serving model's hot modules from a matching mypyc build, when one exists (make
# compiled; KVTOOL_COMPILED=0: never): kvtool.compiled
_compiled.install()
