"""NVMe over TCP in userspace: the PDU codec (:mod:`~kvtool.nvme.pdu`), NVMe structures
(:mod:`~kvtool.nvme.spec`), kvtool's host (:mod:`~kvtool.nvme.host`), ``nvme+tcp://`` URLs
(:mod:`~kvtool.nvme.url`) and the store I/O engine (:mod:`~kvtool.nvme.engine`).
The emulator's target (:mod:`emulator.nvmetcp`) shares the codec. See docs/nvme-tcp.md.
"""
