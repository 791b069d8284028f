"""kvtool's userspace NVMe/TCP target (``python -m emulator.nvmetcp``; docs/nvme-tcp.md).

:class:`~emulator.nvmetcp.target.Target` serves a :class:`~emulator.nvmetcp.config.TargetConfig`:
a discovery controller plus I/O subsystems whose namespaces live in memory, a file or a
block device, with a host allow-list, on 127.0.0.1 unless told otherwise.
"""

from emulator.nvmetcp.config import NamespaceConfig, SubsystemConfig, TargetConfig, simple_config
from emulator.nvmetcp.target import Target

__all__ = ["NamespaceConfig", "SubsystemConfig", "Target", "TargetConfig", "simple_config"]
