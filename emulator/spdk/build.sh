#!/usr/bin/env bash
# Build SPDK's NVMe-oF target and tools (nvmf_tgt, spdk_tgt, spdk_nvme_perf, spdk_nvme_identify,
# scripts/rpc.py) from the source tarballs in ../shared/vendor/spdk, for Debian 12 x86_64,
# with the RDMA transport (rdma-core's verbs and rdmacm from Debian) and the userspace PCIe
# NVMe driver. About 5-8 minutes on 2 cores, once.
#
#   build.sh [PREFIX]                  # default PREFIX=/var/tmp/kvtool-spdk; result in PREFIX/<key>/
#   SPDK_DIR=$(build.sh --print-dir)   # where the build is (or will be), without building
#
# The build is keyed by the tarballs' SHA256SUMS and this script's own text (its configure
# flags and packages), so a finished build is reused and a changed recipe builds beside it.
# It prints the SPDK directory on its last line (bin: $DIR/build/bin, RPC client:
# $DIR/scripts/rpc.py).
#
# Sources: SPDK v26.05 (d519b163), upstream DPDK v26.03 (0e093f95; SPDK v26.05 accepts it),
# ISA-L and ISA-L crypto at the commits SPDK v26.05 pins. Debian's libdpdk-dev (22.11.11) is
# NOT usable: SPDK refuses it at run time ("DPDK version 22.11.11 is not supported").
# Adapted from ../shared/reference/spdk/build.sh (kvtool project), which builds without RDMA.
#
# x86-64-v2, not -march=native: the same binaries run in kvtool's QEMU guest (TCG has no
# AVX-512, which a native build on this machine would use: "Illegal instruction"); ISA-L and
# DPDK pick their vector paths at run time from CPUID either way.
#
# One build for TCP and RDMA: --with-rdma only adds the RDMA transport (lib/nvmf/rdma.c,
# the RDMA host in lib/nvme) and links libibverbs/librdmacm; nothing RDMA runs until an RDMA
# transport or transport ID is asked for, so TCP behaves as before and CI builds SPDK once.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VENDOR=${KVTOOL_SPDK_VENDOR:-$(cd "$HERE/../../../shared/vendor/spdk" 2>/dev/null && pwd || true)}
[ -n "$VENDOR" ] && [ -f "$VENDOR/SHA256SUMS" ] || { echo "no SPDK sources at ../shared/vendor/spdk" >&2; exit 2; }
PREFIX=/var/tmp/kvtool-spdk; PRINT=""
for a in "$@"; do case $a in --print-dir) PRINT=1 ;; *) PREFIX=$a ;; esac; done
KEY=$(cat "$VENDOR/SHA256SUMS" "$0" | sha256sum | cut -c1-12)
DIR=$PREFIX/$KEY/spdk-v26.05
if [ -n "$PRINT" ]; then echo "$DIR"; exit 0; fi
if [ -x "$DIR/build/bin/nvmf_tgt" ] && [ -f "$DIR/.kvtool-built" ]; then echo "$DIR"; exit 0; fi

# Debian's python3 (not a venv's): DPDK's meson and SPDK's genrpc.py need these modules.
# libibverbs-dev/librdmacm-dev: the RDMA transport; ibverbs-providers: the userspace verbs
# drivers (rxe for soft-RoCE) SPDK's RDMA transport loads at run time.
export PATH=/usr/bin:/bin:/usr/sbin:/sbin
pkgs="gcc g++ make pkg-config libcunit1-dev libaio-dev libssl-dev libjson-c-dev uuid-dev
      libnuma-dev libncurses-dev nasm autoconf automake libtool python3 python3-pyelftools
      python3-jinja2 python3-tabulate meson ninja-build libibverbs-dev librdmacm-dev
      ibverbs-providers"
missing=$(for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >/dev/null
fi
(cd "$VENDOR" && sha256sum -c --quiet SHA256SUMS)

rm -rf "${PREFIX:?}/$KEY"; mkdir -p "$PREFIX/$KEY"; cd "$PREFIX/$KEY"
for t in spdk-v26.05 dpdk-v26.03 isa-l-c196241 isa-l-crypto-07d0b25; do tar -xJf "$VENDOR/$t.tar.xz"; done
rmdir spdk-v26.05/dpdk spdk-v26.05/isa-l spdk-v26.05/isa-l-crypto 2>/dev/null || true
mv dpdk-v26.03 spdk-v26.05/dpdk; mv isa-l-c196241 spdk-v26.05/isa-l; mv isa-l-crypto-07d0b25 spdk-v26.05/isa-l-crypto
cd spdk-v26.05
# isa-l's autogen and DPDK's meson expect git metadata only for version strings: none needed.
./configure --target-arch=x86-64-v2 --disable-tests --disable-unit-tests --disable-examples \
  --without-crypto --without-vhost --without-virtio --without-nvme-cuse --without-idxd \
  --without-xnvme --without-ocf --without-vfio-user --with-rdma --without-fc \
  --without-iscsi-initiator --without-uring --without-usdt --without-sma --without-avahi \
  --without-golang --without-rbd --without-daos --without-ublk --without-dpdk-compressdev \
  --without-fio --without-fsdev --without-aio-fsdev --without-dpdk-uadk --without-raid5f \
  >"$PREFIX/$KEY/build.log" 2>&1 || { tail -30 "$PREFIX/$KEY/build.log" >&2; exit 1; }
make -j"$(nproc)" >>"$PREFIX/$KEY/build.log" 2>&1 || { tail -30 "$PREFIX/$KEY/build.log" >&2; exit 1; }
touch .kvtool-built
echo "$DIR"
