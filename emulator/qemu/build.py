"""Build (once, cached) the kernel and initramfs of kvtool's QEMU guest.

The guest is Debian's stock kernel plus a busybox initramfs holding the nvmet, nvmet-tcp,
nvme-tcp, configfs, virtio, 9p and overlay modules (and, optionally, nvme-cli). Packages are
only ``apt-get download``ed and unpacked into the cache directory: nothing is installed into
the host root except qemu-system-x86 when it is missing.

Two kernels: ``6.1`` (bookworm's, the default) and ``6.12`` (bookworm-backports: the one with
NVMe in-band authentication, ``CONFIG_NVME_TARGET_AUTH``/``CONFIG_NVME_AUTH``). The 6.12
kernel package comes through a private apt state for bookworm-backports inside the cache
directory, so the system's apt sources stay untouched; its ``.ko.xz`` modules are unpacked
into the initramfs (busybox insmod reads plain ``.ko`` only). Adapted from the 6.12 recipe
(../shared/reference/qemu-nvmet-612/build.sh).

Cache: ``$KVTOOL_QEMU_DIR`` (default ``/var/tmp/kvtool-qemu``); 6.12: ``$KVTOOL_QEMU_612_DIR``
(default ``/var/tmp/kvtool-qemu-612``). ``ensure_built`` is idempotent
and safe to call from several processes at once (an flock serializes builders). Each initramfs
is named by the digest of its inputs (init script, module lists, this builder's version):
changing them builds a new file beside the old one, so checkouts of different ages share the
cache without rebuilding each other's image. Never commit the output.

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
KERNELS = ("6.1", "6.12")
_DIRS = {"6.1": ("KVTOOL_QEMU_DIR", DEFAULT_DIR),
         "6.12": ("KVTOOL_QEMU_612_DIR", Path("/var/tmp/kvtool-qemu-612"))}
BPO_SOURCE = ("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
              "http://deb.debian.org/debian bookworm-backports main")
QEMU = "qemu-system-x86_64"
BUILDER_VERSION = "1"

# Crypto "generic" providers first: crc-t10dif/crc64-rocksoft soft-depend on them by alias,
# crc32c backs NVMe/TCP header and data digests.
CORE_MODULES = [
    "configfs", "virtio_pci", "virtio_net", "crct10dif_generic", "crc64_rocksoft_generic",
    "crc32c_generic", "nvmet", "nvmet-tcp", "nvme-tcp",
]
# 6.12: nvmet, nvme-core and nvme-tcp depend on these (the DH/HMAC/SHA-2 crypto is built in)
AUTH_MODULES = ["nvme-keyring", "nvme-auth"]
HOSTROOT_MODULES = ["9pnet_virtio", "9p", "overlay"]
# Shipped but loaded by /init only when needed: brd (the default backing) and loop (the
# ``loop`` backing: blk-mq, so the block layer keeps I/O statistics that nvmet's SMART log
# reads; brd is bio-based and keeps none).
ON_DEMAND_MODULES = ["brd", "loop"]
# Loaded by /init with kvt.rdma=1: soft-RoCE (rdma_rxe, whose ICRC needs the "crc32" shash:
# crc32_generic, else `rdma link add` fails with ENOENT), the RDMA CM for userspace (rdma_ucm:
# librdmacm, so SPDK's RDMA transport), and the kernel's NVMe/RDMA host and target.
RDMA_MODULES = ["crc32_generic", "rdma_rxe", "ib_uverbs", "rdma_ucm", "nvme-rdma", "nvmet-rdma"]
# Loaded by /init with kvt.pcie=1: the kernel's NVMe PCIe driver (QEMU's -device nvme) and
# vfio-pci with the type-1 IOMMU backend, for SPDK's userspace driver.
PCIE_MODULES = ["nvme", "vfio-pci", "vfio_iommu_type1"]
# insmod parameters: SPDK without hugepages maps its memory 4 KiB at a time, one vfio DMA
# entry each (1 GiB = 262,144), over vfio_iommu_type1's default limit of 65,535 (ENOSPC)
MODULE_ARGS = {"vfio_iommu_type1.ko": "dma_entry_limit=1048576"}
NVME_CLI_PACKAGES = ["nvme-cli", "libnvme1", "libjson-c5", "libuuid1"]
GUEST_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000kvt0"
# 6.12's nvme-fabrics refuses a host NQN whose host ID another NQN already uses: the 6.12
# guest's default identity is a real UUID pair (hostnqn + hostid), as the recipe ships it.
GUEST_HOSTID_612 = "6b767430-0000-4000-8000-000000000000"
GUEST_HOSTNQN_612 = "nqn.2014-08.org.nvmexpress:uuid:" + GUEST_HOSTID_612


def guest_hostnqn(kernel: str = "6.1") -> str:
    """The host NQN the guest's own nvme-cli presents by default."""
    return GUEST_HOSTNQN_612 if kernel == "6.12" else GUEST_HOSTNQN


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
    series: str = "6.1"  # "6.1" | "6.12"

    @property
    def hostnqn(self) -> str:
        return guest_hostnqn(self.series)


def cache_dir(workdir: Path | str | None = None, kernel: str = "6.1") -> Path:
    env, default = _DIRS[kernel]
    return Path(workdir or os.environ.get(env) or default)


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise BuildError(f"unknown guest kernel {kernel!r} (choose {', '.join(KERNELS)})")


def _bpo_apt(wd: Path) -> list[str]:
    """apt options for a private bookworm-backports state under ``wd`` (created on first use)."""
    bpo = wd / "apt-bpo"
    (bpo / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (bpo / "etc").mkdir(exist_ok=True)
    src = bpo / "etc" / "sources.list"
    if not src.exists():
        src.write_text(BPO_SOURCE + "\n")
    return ["-o", f"Dir::Etc::sourcelist={src}", "-o", "Dir::Etc::sourceparts=-",
            "-o", f"Dir::State::Lists={bpo / 'lists'}"]


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


def _kernel_package(apt: list[str] | None = None) -> str:
    """The kernel package linux-image-amd64 depends on (``apt``: options of a private state)."""
    apt = apt or []

    def query() -> str:
        out = _run(["apt-cache", *apt, "depends", "linux-image-amd64"], what="apt-cache depends")
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
        _apt_update(apt)
        pkg = query()
    if not pkg:
        raise BuildError("apt knows no linux-image-amd64 kernel package (apt sources?)")
    return pkg


def _apt_update(apt: list[str] | None = None) -> None:
    _run(["apt-get", *(apt or []), "update", "-q"],
         what="apt-get update (is the Debian mirror reachable?)")


def _download(debs: Path, packages: list[str], apt: list[str] | None = None) -> None:
    """apt-get download each missing package; a .deb appears in ``debs`` only when complete."""
    debs.mkdir(parents=True, exist_ok=True)
    updated = False
    for pkg in packages:
        if any(debs.glob(f"{pkg}_*.deb")):
            continue
        scratch = debs / ".partial"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        cmd = ["apt-get", *(apt or []), "download", pkg]
        what = f"apt-get download {pkg} (is the Debian mirror reachable?)"
        try:
            _run(cmd, cwd=scratch, what=what)
        except BuildError:
            if updated:
                raise
            _apt_update(apt)
            updated = True
            _run(cmd, cwd=scratch, what=what)
        for deb in scratch.glob("*.deb"):
            deb.replace(debs / deb.name)
        shutil.rmtree(scratch, ignore_errors=True)


def _core_modules(kernel: str) -> list[str]:
    return CORE_MODULES + AUTH_MODULES if kernel == "6.12" else CORE_MODULES


def _inputs_digest(kernel_pkg: str, with_nvme_cli: bool, kernel: str = "6.1") -> str:
    h = hashlib.sha256()
    parts = [BUILDER_VERSION, kernel_pkg, str(with_nvme_cli), " ".join(CORE_MODULES),
             " ".join(HOSTROOT_MODULES), GUEST_HOSTNQN]
    if kernel != "6.1":
        parts += [kernel, " ".join(AUTH_MODULES), GUEST_HOSTNQN_612, "moddeps-xz"]
    parts.append(" ".join(ON_DEMAND_MODULES))
    parts += [" ".join(RDMA_MODULES), " ".join(PCIE_MODULES), json.dumps(MODULE_ARGS)]
    for part in parts:
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


def ensure_built(workdir: Path | str | None = None, *, with_nvme_cli: bool = True,
                 kernel: str = "6.1") -> GuestImage:
    """Build the guest kernel and initramfs unless an up-to-date build is cached; return paths.

    ``kernel``: "6.1" (bookworm) or "6.12" (bookworm-backports, with NVMe authentication).
    Raises BuildError with the reason (not root, apt unreachable, package missing) when the
    image cannot be built.
    """
    _check_kernel(kernel)
    ensure_qemu()
    wd = cache_dir(workdir, kernel)
    with _locked(wd):
        vmlinux_path = wd / "vmlinux"
        # the kernel is shared by both initramfs flavours: its modules must match it
        pinned = (_read_stamp(wd / "vmlinux.json").get("kernel_package")
                  if vmlinux_path.exists() else None)
        # Offline-friendly: a complete cached build is reused without asking apt, as long as
        # the inputs kept in this repository are unchanged. Each set of inputs has its own
        # file (keyed by their digest), so checkouts of different ages sharing this cache
        # never rebuild each other's image.
        if pinned:
            image = _cached(wd, pinned, with_nvme_cli, kernel)
            if image is not None:
                return image
        if os.geteuid() != 0:
            raise BuildError(f"no cached guest image in {wd}, and building one needs root "
                             "(apt-get download, dpkg -x)")
        if not pinned:
            vmlinux_path.unlink(missing_ok=True)
        apt = _bpo_apt(wd) if kernel == "6.12" else None
        try:
            kernel_pkg = pinned or _kernel_package(apt)
            initrd = wd / _initrd_name(kernel_pkg, with_nvme_cli, kernel)
            _build(wd, kernel_pkg, with_nvme_cli, initrd, kernel, apt)
        except BuildError:
            if pinned:
                raise
            # stale package lists name a kernel the mirror no longer has: refresh, retry once
            _apt_update(apt)
            kernel_pkg = _kernel_package(apt)
            initrd = wd / _initrd_name(kernel_pkg, with_nvme_cli, kernel)
            _build(wd, kernel_pkg, with_nvme_cli, initrd, kernel, apt)
        kver = kernel_pkg[len("linux-image-"):]
        Path(str(initrd) + ".json").write_text(json.dumps({
            "digest": _inputs_digest(kernel_pkg, with_nvme_cli, kernel),
            "kernel_package": kernel_pkg,
            "kernel_version": kver,
        }))
        return GuestImage(vmlinux_path, initrd, kver, with_nvme_cli, wd, kernel)


def _initrd_name(kernel_pkg: str, with_nvme_cli: bool, kernel: str) -> str:
    flavour = "initramfs" if with_nvme_cli else "initramfs-nocli"
    return f"{flavour}-{_inputs_digest(kernel_pkg, with_nvme_cli, kernel)}.cpio"


def _cached(wd: Path, kernel_pkg: str, with_nvme_cli: bool, kernel: str) -> GuestImage | None:
    initrd = wd / _initrd_name(kernel_pkg, with_nvme_cli, kernel)
    stamp = _read_stamp(Path(str(initrd) + ".json"))
    if not (stamp and initrd.exists() and stamp.get("kernel_package") == kernel_pkg):
        return None
    return GuestImage(wd / "vmlinux", initrd, stamp["kernel_version"], with_nvme_cli, wd, kernel)


def _build(wd: Path, kernel_pkg: str, with_nvme_cli: bool, initrd: Path, series: str = "6.1",
           apt: list[str] | None = None) -> None:
    kver = kernel_pkg[len("linux-image-"):]
    packages = [kernel_pkg, "busybox-static"] + (NVME_CLI_PACKAGES if with_nvme_cli else [])
    debs = wd / "debs"
    _download(debs, [kernel_pkg], apt)  # from bookworm-backports for 6.12
    _download(debs, packages[1:])
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
        _initramfs_tree(root, x, moddir, with_nvme_cli, series)
        tmp = initrd.with_suffix(".tmp")
        with tmp.open("wb") as out:
            cpio.write_newc(root, out)
        tmp.replace(initrd)
        shutil.rmtree(root, ignore_errors=True)
    finally:
        # the unpacked modules tree is ~600 MB; the .debs stay for rebuilds
        shutil.rmtree(x, ignore_errors=True)


def _initramfs_tree(root: Path, x: Path, moddir: Path, with_nvme_cli: bool,
                    series: str = "6.1") -> None:
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "lib/modules", "proc", "sys", "dev", "tmp",
              "run", "etc", "mnt"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(x / "bin" / "busybox", root / "bin" / "busybox")
    shutil.copyfile(HERE / "init.sh", root / "init")
    (root / "init").chmod(0o755)

    modules = _core_modules(series)
    core = moddeps.resolve(moddir, modules)
    everything = moddeps.resolve(moddir, modules + HOSTROOT_MODULES + ON_DEMAND_MODULES
                                 + RDMA_MODULES + PCIE_MODULES)
    rdma = [m for m in moddeps.resolve(moddir, RDMA_MODULES) if m not in core]
    pcie = [m for m in moddeps.resolve(moddir, PCIE_MODULES) if m not in core]
    on_demand = set(moddeps.resolve(moddir, ON_DEMAND_MODULES)) | set(rdma) | set(pcie)
    on_demand -= set(core)
    plain = moddeps.plain
    (root / "modules.load").write_text("".join(plain(m) + "\n" for m in core))
    (root / "modules-9p.load").write_text("".join(
        plain(m) + "\n" for m in everything if m not in core and m not in on_demand))
    def line(m: str) -> str:
        args = MODULE_ARGS.get(os.path.basename(plain(m)))
        return plain(m) + (f" {args}" if args else "") + "\n"

    (root / "modules-rdma.load").write_text("".join(line(m) for m in rdma))
    (root / "modules-pcie.load").write_text("".join(line(m) for m in pcie))
    for m in everything:
        dest = root / "lib" / "modules" / plain(m)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if plain(m) == m:
            shutil.copy2(moddir / m, dest)
        else:
            dest.write_bytes(moddeps.read_module(moddir / m))

    if with_nvme_cli:
        _add_nvme_cli(root, x, series)


def _add_nvme_cli(root: Path, x: Path, series: str = "6.1") -> None:
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
    (root / "etc" / "nvme" / "hostnqn").write_text(guest_hostnqn(series) + "\n")
    if series == "6.12":
        (root / "etc" / "nvme" / "hostid").write_text(GUEST_HOSTID_612 + "\n")
