"""SPDK, built from the vendored sources, as a real component: its NVMe-oF target
(``nvmf_tgt``/``spdk_tgt``) and its host tools, run without hugepages on 127.0.0.1.

* ``find_spdk(build=True)`` -> ``SpdkInstall``: ``$KVTOOL_SPDK_DIR``, else the cached build
  of ``../shared/vendor/spdk`` (built once by ``../shared/reference/spdk/build.sh``).
* ``SpdkApp(install).start()``: one application with a private RPC socket; ``rpc()``, ``stop()``.
* ``emulator.spdk.tools``: spdk_nvme_identify / spdk_nvme_perf / spdk_nvme_discover runs.

See docs/spdk.md.
"""

from emulator.spdk.app import SpdkApp, SpdkAppError
from emulator.spdk.build import SpdkInstall, SpdkNotFound, find_spdk

__all__ = ["SpdkApp", "SpdkAppError", "SpdkInstall", "SpdkNotFound", "find_spdk"]
