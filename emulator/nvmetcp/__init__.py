"""kvtool's userspace NVMe/TCP target (``python -m emulator.nvmetcp``; docs/nvme-tcp.md).

:class:`~emulator.nvmetcp.target.Target` serves a :class:`~emulator.nvmetcp.config.EmulatorConfig`:
a discovery controller plus I/O subsystems whose namespaces live in memory, a file or a
block device, with a host allow-list, on 127.0.0.1 unless told otherwise.
"""

from emulator.nvmetcp.config import EmulatorConfig, NamespaceConfig, SubsystemConfig, simple_config
from emulator.nvmetcp.target import Target

__all__ = ["EmulatorConfig", "NamespaceConfig", "SubsystemConfig", "Target", "simple_config"]
