"""kvtool: tools and a reference emulator for KV-cache tiered storage (GPU → DRAM → NVMe/NVMe-oF)."""

__version__ = "0.1.0"
