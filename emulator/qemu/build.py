"""Build (once, cached) the kernel and initramfs of kvtool's QEMU guest.

The guest is Debian's stock kernel plus a busybox initramfs holding the nvmet, nvmet-tcp,
nvme-tcp, configfs, virtio, 9p and overlay modules (and, optionally, nvme-cli). Packages are
only ``apt-get download``ed and unpacked into the cache directory: nothing is installed into
the host root except qemu-system-x86 when it is missing.

Cache: ``$KVTOOL_QEMU_DIR`` (default ``/var/tmp/kvtool-qemu``). ``ensure_built`` is idempotent
and safe to call from several processes at once (an flock serializes builders); an image is
rebuilt when a file is missing or when its inputs (init script, module list, this builder's
version) change. Never commit the output.

Adapted from the qemu-nvmet recipe (../shared/reference/qemu-nvmet/build.sh, kvtool project).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from emulator.qemu import cpio, moddeps, vmlinux

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = Path("/var/tmp/kvtool-qemu")
QEMU = "qemu-system-x86_64"
BUILDER_VERSION = "1"

# Crypto "generic" providers first: crc-t10dif/crc64-rocksoft soft-depend on them by alias,
# crc32c backs NVMe/TCP header and data digests.
CORE_MODULES = [
    "configfs", "virtio_pci", "virtio_net", "crct10dif_generic", "crc64_rocksoft_generic",
    "crc32c_generic", "nvmet", "nvmet-tcp", "nvme-tcp",
]
HOSTROOT_MODULES = ["9pnet_virtio", "9p", "overlay"]
NVME_CLI_PACKAGES = ["nvme-cli", "libnvme1", "libjson-c5", "libuuid1"]
GUEST_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000kvt0"


class BuildError(RuntimeError):
    """The guest image cannot be built here; the message says why and what to do."""


@dataclass(frozen=True)
class GuestImage:
    """Paths of a built guest: boot ``kernel`` (PVH ELF) with ``initrd`` (uncompressed cpio)."""

    kernel: Path
    initrd: Path
    kernel_version: str
    with_nvme_cli: bool
    workdir: Path


def cache_dir(workdir: Path | str | None = None) -> Path:
    return Path(workdir or os.environ.get("KVTOOL_QEMU_DIR") or DEFAULT_DIR)


def _run(cmd: list[str], *, cwd: Path | None = None, what: str) -> str:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C")
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise BuildError(f"{what}: {cmd[0]} not found (needs Debian's apt/dpkg)") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise BuildError(f"{what}: `{' '.join(cmd)}` exited {proc.returncode}: {' | '.join(tail)}")
    return proc.stdout


def ensure_qemu() -> str:
    """Path of qemu-system-x86_64, apt-installing qemu-system-x86 when it is missing."""
    found = shutil.which(QEMU)
    if found:
        return found
    if os.geteuid() != 0:
        raise BuildError(f"{QEMU} is missing; install it: apt-get install qemu-system-x86")
    _apt_update()
    _run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "qemu-system-x86"],
        what="installing qemu-system-x86",
    )
    found = shutil.which(QEMU)
    if not found:
        raise BuildError(f"{QEMU} still missing after installing qemu-system-x86")
    return found


def _kernel_package() -> str:
    def query() -> str:
        out = _run(["apt-cache", "depends", "linux-image-amd64"], what="apt-cache depends")
        for line in out.splitlines():
            parts = line.split()
            if (len(parts) == 2 and parts[0] == "Depends:"
                    and parts[1].startswith("linux-image-")
                    and parts[1][len("linux-image-"):][:1].isdigit()):
                return parts[1]
        return ""

    try:
        pkg = query()
    except BuildError:
        pkg = ""
    if not pkg:
        _apt_update()
        pkg = query()
    if not pkg:
        raise BuildError("apt knows no linux-image-amd64 kernel package (apt sources?)")
    return pkg


def _apt_update() -> None:
    _run(["apt-get", "update", "-q"], what="apt-get update (is the Debian mirror reachable?)")


def _download(debs: Path, packages: list[str]) -> None:
    """apt-get download each missing package; a .deb appears in ``debs`` only when complete."""
    debs.mkdir(parents=True, exist_ok=True)
    updated = False
    for pkg in packages:
        if any(debs.glob(f"{pkg}_*.deb")):
            continue
        scratch = debs / ".partial"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        cmd = ["apt-get", "download", pkg]
        what = f"apt-get download {pkg} (is the Debian mirror reachable?)"
        try:
            _run(cmd, cwd=scratch, what=what)
        except BuildError:
            if updated:
                raise
            _apt_update()
            updated = True
            _run(cmd, cwd=scratch, what=what)
        for deb in scratch.glob("*.deb"):
            deb.replace(debs / deb.name)
        shutil.rmtree(scratch, ignore_errors=True)


def _inputs_digest(kernel_pkg: str, with_nvme_cli: bool) -> str:
    h = hashlib.sha256()
    for part in (BUILDER_VERSION, kernel_pkg, str(with_nvme_cli), " ".join(CORE_MODULES),
                 " ".join(HOSTROOT_MODULES), GUEST_HOSTNQN):
        h.update(part.encode() + b"\0")
    h.update((HERE / "init.sh").read_bytes())
    return h.hexdigest()[:16]


@contextmanager
def _locked(workdir: Path) -> Iterator[None]:
    workdir.mkdir(parents=True, exist_ok=True)
    with (workdir / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_stamp(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def ensure_built(workdir: Path | str | None = None, *, with_nvme_cli: bool = True) -> GuestImage:
    """Build the guest kernel and initramfs unless an up-to-date build is cached; return paths.

    Raises BuildError with the reason (not root, apt unreachable, package missing) when the
    image cannot be built.
    """
    ensure_qemu()
    wd = cache_dir(workdir)
    initrd_name = "initramfs.cpio" if with_nvme_cli else "initramfs-nocli.cpio"
    with _locked(wd):
        stamp_path = wd / (initrd_name + ".json")
        stamp = _read_stamp(stamp_path)
        kernel = wd / "vmlinux"
        initrd = wd / initrd_name
        # Offline-friendly: a complete cached build is reused without asking apt, as long as
        # the inputs kept in this repository are unchanged.
        if (stamp and kernel.exists() and initrd.exists()
                and stamp.get("digest") == _inputs_digest(stamp.get("kernel_package", ""),
                                                          with_nvme_cli)):
            return GuestImage(kernel, initrd, stamp["kernel_version"], with_nvme_cli, wd)
        if os.geteuid() != 0:
            raise BuildError(f"no cached guest image in {wd}, and building one needs root "
                             "(apt-get download, dpkg -x)")
        # the kernel is shared by both initramfs flavours: its modules must match it
        pinned = _read_stamp(wd / "vmlinux.json").get("kernel_package") if kernel.exists() else None
        if not pinned:
            kernel.unlink(missing_ok=True)
        try:
            kernel_pkg = pinned or _kernel_package()
            _build(wd, kernel_pkg, with_nvme_cli, initrd)
        except BuildError:
            if pinned:
                raise
            # stale package lists name a kernel the mirror no longer has: refresh, retry once
            _apt_update()
            kernel_pkg = _kernel_package()
            _build(wd, kernel_pkg, with_nvme_cli, initrd)
        kver = kernel_pkg[len("linux-image-"):]
        stamp_path.write_text(json.dumps({
            "digest": _inputs_digest(kernel_pkg, with_nvme_cli),
            "kernel_package": kernel_pkg,
            "kernel_version": kver,
        }))
        return GuestImage(kernel, initrd, kver, with_nvme_cli, wd)


def _build(wd: Path, kernel_pkg: str, with_nvme_cli: bool, initrd: Path) -> None:
    kver = kernel_pkg[len("linux-image-"):]
    packages = [kernel_pkg, "busybox-static"] + (NVME_CLI_PACKAGES if with_nvme_cli else [])
    debs = wd / "debs"
    _download(debs, packages)
    x = wd / "x"
    shutil.rmtree(x, ignore_errors=True)
    x.mkdir()
    try:
        for pkg in packages:
            deb = sorted(debs.glob(f"{pkg}_*.deb"))[-1]
            _run(["dpkg", "-x", str(deb), str(x)], what=f"unpacking {deb.name}")
        moddir = x / "lib" / "modules" / kver
        kernel = wd / "vmlinux"
        if not kernel.exists():
            vmlinux.extract_file(x / "boot" / f"vmlinuz-{kver}", kernel)
            (wd / "vmlinux.json").write_text(json.dumps({"kernel_package": kernel_pkg}))
        root = wd / "root"
        shutil.rmtree(root, ignore_errors=True)
        _initramfs_tree(root, x, moddir, with_nvme_cli)
        tmp = initrd.with_suffix(".tmp")
        with tmp.open("wb") as out:
            cpio.write_newc(root, out)
        tmp.replace(initrd)
        shutil.rmtree(root, ignore_errors=True)
    finally:
        # the unpacked modules tree is ~600 MB; the .debs stay for rebuilds
        shutil.rmtree(x, ignore_errors=True)


def _initramfs_tree(root: Path, x: Path, moddir: Path, with_nvme_cli: bool) -> None:
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "lib/modules", "proc", "sys", "dev", "tmp",
              "run", "etc", "mnt"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(x / "bin" / "busybox", root / "bin" / "busybox")
    shutil.copyfile(HERE / "init.sh", root / "init")
    (root / "init").chmod(0o755)

    core = moddeps.resolve(moddir, CORE_MODULES)
    everything = moddeps.resolve(moddir, CORE_MODULES + HOSTROOT_MODULES)
    (root / "modules.load").write_text("".join(m + "\n" for m in core))
    (root / "modules-9p.load").write_text("".join(m + "\n" for m in everything if m not in core))
    for m in [*everything, "kernel/drivers/block/brd.ko"]:
        dest = root / "lib" / "modules" / m
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(moddir / m, dest)

    if with_nvme_cli:
        _add_nvme_cli(root, x)


def _add_nvme_cli(root: Path, x: Path) -> None:
    """nvme-cli is dynamically linked: ship it with its own libs plus the host's (Debian 12)."""
    libdir = root / "usr" / "lib" / "x86_64-linux-gnu"
    libdir.mkdir(parents=True, exist_ok=True)
    (root / "lib64").mkdir(exist_ok=True)
    (root / "etc" / "nvme").mkdir(parents=True, exist_ok=True)
    shutil.copy2(x / "usr" / "sbin" / "nvme", root / "usr" / "sbin" / "nvme")
    xlib = x / "usr" / "lib" / "x86_64-linux-gnu"
    # with LD_LIBRARY_PATH, ldd resolves nvme-cli's own libs from the unpacked packages and the
    # rest (libcrypto, libsystemd, glibc, ...) from the host
    env = dict(os.environ, LD_LIBRARY_PATH=str(xlib))
    ldd = subprocess.run(["ldd", str(x / "usr" / "sbin" / "nvme")], env=env,
                         capture_output=True, text=True, check=False).stdout
    missing = [line.split()[0] for line in ldd.splitlines() if "not found" in line]
    if missing:
        raise BuildError(f"nvme-cli needs host libraries that are missing: {', '.join(missing)}")
    for line in ldd.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/"):
            shutil.copyfile(Path(parts[2]).resolve(), libdir / parts[0])
    shutil.copyfile(Path("/lib64/ld-linux-x86-64.so.2").resolve(),
                    root / "lib64" / "ld-linux-x86-64.so.2")
    (root / "lib64" / "ld-linux-x86-64.so.2").chmod(0o755)
    (root / "etc" / "nvme" / "hostnqn").write_text(GUEST_HOSTNQN + "\n")
