"""SPDK's host tools as a real component: spdk_nvme_identify / spdk_nvme_perf /
spdk_nvme_discover runs against any NVMe/TCP target (``emulator.spdk.tools``).

SPDK itself (where it comes from, how it is built, and running its ``nvmf_tgt``/``spdk_tgt``
without hugepages) is the target's business: :mod:`kvtool.target.spdk.install`
(``find_spdk``, ``SpdkInstall``) and :mod:`kvtool.target.spdk.app` (``SpdkApp``).
See docs/spdk.md.
"""
