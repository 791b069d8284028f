"""The real Linux kernel (nvmet-tcp target, nvme-tcp host) in a QEMU guest, reached on 127.0.0.1.

* ``emulator.qemu.build.ensure_built()`` -> ``GuestImage``: downloads and caches the kernel and
  initramfs (``$KVTOOL_QEMU_DIR``, default ``/var/tmp/kvtool-qemu``).
* ``emulator.qemu.guest.Guest``: boots one TCG guest with loopback port forwards, an optional
  auto-configured nvmet-tcp target, guest-to-host forwards and a control shell.

See docs/qemu-guest.md.
"""

from emulator.qemu.build import BuildError, GuestImage, ensure_built
from emulator.qemu.guest import Guest, GuestError, guest_exec

__all__ = ["BuildError", "Guest", "GuestError", "GuestImage", "ensure_built", "guest_exec"]
