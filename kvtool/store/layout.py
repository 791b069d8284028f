"""The on-namespace layout of a kvtool object store (diagram: docs/store-layout.md).

::

    offset 0            META_BLOCK (4 KiB)     superblock, written once when formatted
    META_BLOCK          index_bytes            one 64-byte entry per slot
    data_offset (1 MiB aligned)                slot 0 | slot 1 | ... | slot N-1
                                               (slot = object padded to whole LBAs)

Every region starts on a multiple of the logical block size. All integers are
little-endian. The superblock and every index entry carry their own CRC32C, so a torn or
flipped entry is detected rather than trusted. Entry *i* always describes slot *i*
(``offset == data_offset + i * slot_bytes``).
"""

from __future__ import annotations

import struct
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool.align import padded_size, round_up
from kvtool.store.checksum import crc32c

MAGIC = b"KVTSTORE"
VERSION = 1
META_BLOCK = 4096
"""Bytes reserved for the superblock (≥ one LBA on 512 B and 4 KiB namespaces)."""
DATA_ALIGN = 1 << 20
"""The data area starts on a 1 MiB boundary (erase-block and RAID-stripe friendly)."""
ENTRY_BYTES = 64
FLAG_VALID = 1
ORDINAL_NONE = (1 << 64) - 1
"""``ordinal`` of an object not written by ``kvtool load`` (no deterministic payload)."""
ORDINAL_KEYED = (1 << 64) - 2
"""``ordinal`` of an object whose bytes are the deterministic payload of its key but which
is not in ``kvtool load``'s key sequence (a data-mode replay's NVMe tier): verify checks
its content as well as its CRC."""

PAYLOAD_SYNTHETIC = 0
PAYLOAD_FILE = 1
PAYLOAD_KINDS = {PAYLOAD_SYNTHETIC: "synthetic", PAYLOAD_FILE: "file"}

_SB = struct.Struct("<8sHHIIIQQQQQQQ16sQQIIIB3xIIQ64s16s")
SB_CRC_OFFSET = META_BLOCK - 4

ENTRY_DTYPE = np.dtype([
    ("key", "<u8"), ("store_tag", "<u8"), ("offset", "<u8"), ("length", "<u8"),
    ("generation", "<u8"), ("ordinal", "<u8"), ("data_crc", "<u4"), ("lba_count", "<u4"),
    ("flags", "<u4"), ("entry_crc", "<u4"),
])
assert ENTRY_DTYPE.itemsize == ENTRY_BYTES


@dataclass(frozen=True)
class Geometry:
    """Where the objects came from (informational; recorded for integrations)."""

    model: str = ""
    dtype: str = ""
    block_tokens: int = 0
    tp: int = 0


@dataclass(frozen=True)
class Superblock:
    """The store's identity and layout. Written once by format; never rewritten."""

    lba_size: int
    physical_block_size: int
    object_bytes: int
    slot_bytes: int
    slot_count: int
    index_offset: int
    index_bytes: int
    data_offset: int
    device_bytes: int
    uuid: bytes
    created_ns: int
    seed: int
    geometry: Geometry = field(default_factory=Geometry)
    payload_kind: int = PAYLOAD_SYNTHETIC
    payload_crc: int = 0
    payload_bytes: int = 0
    version: int = VERSION

    @property
    def store_tag(self) -> int:
        """First 8 bytes of the UUID: stamped into every entry of this format."""
        return int.from_bytes(self.uuid[:8], "little")

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes

    def encode(self) -> bytes:
        head = _SB.pack(
            MAGIC, self.version, 0, META_BLOCK, self.lba_size, self.physical_block_size,
            self.object_bytes, self.slot_bytes, self.slot_count, self.index_offset,
            self.index_bytes, self.data_offset, self.device_bytes, self.uuid, self.created_ns,
            self.seed, ENTRY_BYTES, self.geometry.block_tokens, self.geometry.tp,
            self.payload_kind, self.payload_crc, 0, self.payload_bytes,
            self.geometry.model.encode()[:64], self.geometry.dtype.encode()[:16])
        body = head + bytes(SB_CRC_OFFSET - len(head))
        return body + struct.pack("<I", crc32c(body))

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Superblock:
        """Parse a superblock; :class:`NotAStore` or :class:`BadSuperblock` on failure."""
        raw = bytes(raw[:META_BLOCK])
        if raw[:8] != MAGIC:
            raise NotAStore("no kvtool superblock (magic 'KVTSTORE' absent at offset 0)")
        (stored,) = struct.unpack_from("<I", raw, SB_CRC_OFFSET)
        if crc32c(raw[:SB_CRC_OFFSET]) != stored:
            raise BadSuperblock("superblock checksum mismatch (offset 0): the store's "
                                "identity and layout cannot be trusted")
        f = _SB.unpack_from(raw)
        (_, version, _, _, lba, phys, obj, slot, count, ioff, ibytes, doff, dev, uid, created,
         seed, entry_bytes, btok, tp, pkind, pcrc, _, pbytes, model, dtype) = f
        if version != VERSION or entry_bytes != ENTRY_BYTES:
            raise BadSuperblock(f"unsupported store version {version} (entry size "
                                f"{entry_bytes}); this kvtool reads version {VERSION}")
        geo = Geometry(model.rstrip(b"\0").decode(errors="replace"),
                       dtype.rstrip(b"\0").decode(errors="replace"), btok, tp)
        return cls(lba, phys, obj, slot, count, ioff, ibytes, doff, dev, uid, created, seed,
                   geo, pkind, pcrc, pbytes, version)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "uuid": str(uuidlib.UUID(bytes=self.uuid)),
            "lba_size": self.lba_size, "physical_block_size": self.physical_block_size,
            "object_bytes": self.object_bytes, "slot_bytes": self.slot_bytes,
            "slot_count": self.slot_count, "index_offset": self.index_offset,
            "index_bytes": self.index_bytes, "data_offset": self.data_offset,
            "device_bytes": self.device_bytes, "created_ns": self.created_ns,
            "seed": self.seed,
            "geometry": {"model": self.geometry.model or None,
                         "dtype": self.geometry.dtype or None,
                         "block_tokens": self.geometry.block_tokens or None,
                         "tp": self.geometry.tp or None},
            "payload": {"kind": PAYLOAD_KINDS.get(self.payload_kind, "unknown"),
                        "crc32c": self.payload_crc if self.payload_kind else None,
                        "bytes": self.payload_bytes if self.payload_kind else None},
        }


class NotAStore(Exception):
    """The target carries no kvtool superblock."""


class BadSuperblock(Exception):
    """A kvtool superblock is present but damaged or of an unknown version."""


def plan_layout(device_bytes: int, object_bytes: int, lba_size: int) -> tuple[int, int, int]:
    """``(slot_count, index_bytes, data_offset)`` fitting the most slots on the device.

    Returns a slot count of 0 when not even one object fits.
    """
    slot = padded_size(object_bytes, lba_size)
    meta = round_up(META_BLOCK, lba_size)

    def need(n: int) -> tuple[int, int]:
        ibytes = round_up(max(n, 1) * ENTRY_BYTES, max(META_BLOCK, lba_size))
        doff = round_up(meta + ibytes, DATA_ALIGN)
        return ibytes, doff

    def fits(n: int) -> bool:
        return need(n)[1] + n * slot <= device_bytes

    # need(n) grows with n, so binary-search the largest n that fits; each slot costs at
    # least slot + ENTRY_BYTES bytes, which bounds the search.
    lo, hi = 0, max(0, (device_bytes - meta) // (slot + ENTRY_BYTES))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    ibytes, doff = need(lo)
    return lo, ibytes, doff


def new_superblock(*, device_bytes: int, object_bytes: int, lba_size: int,
                   physical_block_size: int, seed: int, created_ns: int,
                   geometry: Geometry | None = None, payload_kind: int = PAYLOAD_SYNTHETIC,
                   payload_crc: int = 0, payload_bytes: int = 0) -> Superblock:
    count, ibytes, doff = plan_layout(device_bytes, object_bytes, lba_size)
    return Superblock(
        lba_size=lba_size, physical_block_size=physical_block_size, object_bytes=object_bytes,
        slot_bytes=padded_size(object_bytes, lba_size), slot_count=count,
        index_offset=round_up(META_BLOCK, lba_size), index_bytes=ibytes, data_offset=doff,
        device_bytes=device_bytes, uuid=uuidlib.uuid4().bytes, created_ns=created_ns,
        seed=seed, geometry=geometry or Geometry(), payload_kind=payload_kind,
        payload_crc=payload_crc, payload_bytes=payload_bytes)


def entry_crc(entries: np.ndarray) -> np.ndarray:
    """CRC32C of the first 60 bytes of each entry (vector of uint32)."""
    raw = entries.view(np.uint8).reshape(-1, ENTRY_BYTES)
    return np.fromiter((crc32c(raw[i, :60]) for i in range(raw.shape[0])), dtype=np.uint32,
                       count=raw.shape[0])


def seal(entries: np.ndarray) -> None:
    """Set ``entry_crc`` of each entry in place."""
    entries["entry_crc"] = entry_crc(entries)


@dataclass(frozen=True)
class Written:
    """One object whose data write into ``slot`` has completed, ready to commit: its
    ``key``, ``length`` in bytes, CRC32C of those bytes (``crc``) and ``ordinal``
    (``ORDINAL_NONE`` when the object has none). Invariant: ``slot`` is this store's and
    nobody else's (allocated from it, or taken by :meth:`ObjectStore.commit_written`)."""

    slot: int
    key: int
    length: int
    crc: int
    ordinal: int = ORDINAL_NONE
