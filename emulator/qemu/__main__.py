"""Command-line launcher for kvtool's QEMU kernel guest.

  python -m emulator.qemu build [--kernel 6.12] build (or reuse) the cached kernel + initramfs
  python -m emulator.qemu run [options]         boot a guest, print one JSON ready line, serve
                                                until SIGINT/SIGTERM
  python -m emulator.qemu exec PORT 'shell'     run shell in a guest via its control port

Example:
  python -m emulator.qemu run --nqn nqn.2024-01.io.kvtool:demo --port 14420
  # -> {"event": "ready", "target": "127.0.0.1:14420", "subnqn": ..., "control_port": ...}
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from types import FrameType

from emulator.qemu.build import KERNELS, BuildError, cache_dir, ensure_built
from emulator.qemu.guest import (
    DEFAULT_NQN,
    GUESTFWD_ADDR,
    TARGET_PORT,
    Guest,
    GuestError,
    guest_exec,
)


def _port_number(text: str, low: int) -> int:
    """A TCP port in low..65535 (0 = pick a free one, where ``low`` allows it)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not low <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port {low}..65535, got {text!r}")
    return port


def _port(text: str) -> int:
    return _port_number(text, 1)


def _port_or_0(text: str) -> int:
    return _port_number(text, 0)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _forward(text: str) -> tuple[int, int]:
    guest, _, host = text.partition(":")
    try:
        return _port(guest), _port_or_0(host or "0")
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected GUEST_PORT[:HOST_PORT], got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m emulator.qemu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build or reuse the guest image")
    b.add_argument("--workdir", help="cache directory (default $KVTOOL_QEMU_DIR or "
                   "/var/tmp/kvtool-qemu)")
    b.add_argument("--no-nvme-cli", action="store_true", help="leave nvme-cli out")
    b.add_argument("--kernel", choices=KERNELS, default="6.1",
                   help="6.1 (bookworm) or 6.12 (bookworm-backports: NVMe DH-HMAC-CHAP)")
    r = sub.add_parser("run", help="boot a guest and keep it up")
    r.add_argument("--no-target", action="store_true",
                   help="configure no nvmet target (modules loaded, configfs mounted)")
    r.add_argument("--nqn", default=DEFAULT_NQN)
    r.add_argument("--size-mb", type=_positive, default=64)
    r.add_argument("--backing", choices=("ram", "file", "loop"), default="ram")
    r.add_argument("--allow-host", action="append", default=[], metavar="HOSTNQN")
    r.add_argument("--port", type=_port_or_0, default=0,
                   help="host 127.0.0.1 port for the guest's port 4420 (default: a free one)")
    r.add_argument("--forward", action="append", type=_forward, default=[],
                   metavar="GUEST_PORT[:HOST_PORT]", help="another host -> guest forward")
    r.add_argument("--guest-forward", action="append", type=_port, default=[], metavar="PORT",
                   help=f"let the guest reach host 127.0.0.1:PORT at {GUESTFWD_ADDR}:PORT")
    r.add_argument("--hostroot", action="store_true", help="share host / read-only (9p)")
    r.add_argument("--mem-mb", type=_positive, default=256)
    r.add_argument("--kernel", choices=KERNELS, default="6.1", help="guest kernel series")
    e = sub.add_parser("exec", help="run a shell snippet in a running guest")
    e.add_argument("control_port", type=_port)
    e.add_argument("shell")
    e.add_argument("--timeout", type=float, default=60.0)
    return ap


def _exec(port: int, shell: str, timeout: float) -> int:
    rc, out = guest_exec(port, shell, timeout)
    sys.stdout.write(out)
    return rc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "build":
            image = ensure_built(args.workdir, with_nvme_cli=not args.no_nvme_cli,
                                 kernel=args.kernel)
            print(json.dumps({"kernel": str(image.kernel), "initrd": str(image.initrd),
                              "kernel_version": image.kernel_version,
                              "cache": str(cache_dir(args.workdir, args.kernel))}))
            return 0
        if args.cmd == "exec":
            return _exec(args.control_port, args.shell, args.timeout)
        forwards = dict(args.forward)
        forwards[TARGET_PORT] = args.port
        guest = Guest(ensure_built(kernel=args.kernel), target=not args.no_target, nqn=args.nqn,
                      size_mb=args.size_mb, backing=args.backing,
                      allowed_hosts=args.allow_host, forwards=forwards,
                      guest_forwards=args.guest_forward, hostroot=args.hostroot,
                      mem_mb=args.mem_mb)
        stop = threading.Event()

        def on_signal(_sig: int, _frame: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        with guest:
            ready = {"event": "ready", "boot_seconds": round(guest.boot_seconds or 0, 2),
                     "target": f"127.0.0.1:{guest.target_port}" if guest.target else None,
                     "subnqn": guest.nqn if guest.target else None,
                     "forwards": {str(g): guest.host_port(g) for g in sorted(forwards)},
                     "control_port": guest.control_port, "pid": guest.pid}
            print(json.dumps(ready), flush=True)
            while not stop.wait(0.5):
                if not guest.running:
                    print("qemu exited", file=sys.stderr)
                    return 1
        return 0
    except (BuildError, GuestError, ValueError, OSError) as e:
        print(f"emulator.qemu: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
