"""NVMe/TCP PDU codec, shared by kvtool's host and the emulator's target.

Byte layouts follow the NVMe/TCP transport specification 1.0a as implemented by Linux
(``include/linux/nvme-tcp.h``) and SPDK (``nvmf_spec.h``); see docs/nvme-tcp.md.

Every PDU starts with the 8-byte common header (type, flags, HLEN, PDO, PLEN). After the
HLEN header bytes come the header digest (4 bytes, when negotiated and applicable), padding
up to PDO, the data, and the data digest (4 bytes, when negotiated and data is present).

Invariants kept by :func:`encode` and checked by :class:`PduParser`:

* HLEN is the fixed value of the PDU type (:data:`HLEN`), PLEN covers the whole PDU.
* Digests appear exactly when negotiated for the connection and applicable to the type
  (HDGST on capsules, data and R2T PDUs; DDGST on PDUs carrying data; never on ICReq,
  ICResp or TermReq), and the HDGSTF/DDGSTF flags say so.
* PDO is 0 when there is no data, else HLEN (+4 with a header digest).
* For H2CData/C2HData, DATAL equals the bytes of data carried.
* SUCCESS is set only together with LAST_PDU, and only on C2HData.

Malformed input raises :class:`PduError` carrying the fatal error status (FES) and the
field offset (FEI) that a receiver puts into its TermReq.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import google_crc32c

# --- constants ---------------------------------------------------------------------------


class PduType(enum.IntEnum):
    ICREQ = 0x00
    ICRESP = 0x01
    H2C_TERM_REQ = 0x02
    C2H_TERM_REQ = 0x03
    CAPSULE_CMD = 0x04
    CAPSULE_RESP = 0x05
    H2C_DATA = 0x06
    C2H_DATA = 0x07
    R2T = 0x09


FLAG_HDGSTF = 0x01
FLAG_DDGSTF = 0x02
FLAG_LAST_PDU = 0x04
FLAG_SUCCESS = 0x08

HLEN: dict[int, int] = {
    PduType.ICREQ: 128,
    PduType.ICRESP: 128,
    PduType.H2C_TERM_REQ: 24,
    PduType.C2H_TERM_REQ: 24,
    PduType.CAPSULE_CMD: 72,
    PduType.CAPSULE_RESP: 24,
    PduType.H2C_DATA: 24,
    PduType.C2H_DATA: 24,
    PduType.R2T: 24,
}
_HDGST_TYPES = frozenset(
    {PduType.CAPSULE_CMD, PduType.CAPSULE_RESP, PduType.H2C_DATA, PduType.C2H_DATA, PduType.R2T}
)
_DATA_TYPES = frozenset({PduType.CAPSULE_CMD, PduType.H2C_DATA, PduType.C2H_DATA})
_TERM_TYPES = frozenset({PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ})

DIGEST_LEN = 4
TERM_MAX_ERROR_HEADER = 128  # TermReq carries at most 128 bytes of the offending header

# Fatal error status (FES) values of a TermReq.
FES_INVALID_HEADER_FIELD = 0x01
FES_PDU_SEQUENCE_ERROR = 0x02
FES_HEADER_DIGEST_ERROR = 0x03
FES_DATA_OUT_OF_RANGE = 0x04
FES_DATA_LIMIT_EXCEEDED = 0x05
FES_UNSUPPORTED_PARAMETER = 0x06

# SGL descriptor identifiers (byte 15 of the descriptor: type << 4 | subtype).
SGL_DATA_BLOCK_OFFSET = 0x01  # in-capsule data: address = offset into the capsule data
SGL_TRANSPORT_DATA_BLOCK = 0x5A  # data moves in C2HData / R2T + H2CData PDUs

# PSDT = 01b (SGL, metadata contiguous) in the SQE flags byte.
SQE_FLAGS_PSDT_SGL = 0x40

_CH = struct.Struct("<BBBBI")
_ICREQ = struct.Struct("<HBBI")
_ICRESP = struct.Struct("<HBBI")
_DATA_HDR = struct.Struct("<HHII4x")
_R2T_HDR = struct.Struct("<HHII4x")
_TERM_HDR = struct.Struct("<HI10x")
_DIGEST = struct.Struct("<I")


class PduError(Exception):
    """A received PDU violates the protocol; ``fes``/``fei`` go into the TermReq."""

    def __init__(self, message: str, *, fes: int = FES_INVALID_HEADER_FIELD, fei: int = 0) -> None:
        super().__init__(message)
        self.fes = fes
        self.fei = fei


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli), init and final XOR 0xFFFFFFFF: ``crc32c(b"123456789") == 0xE3069283``."""
    if type(data) is not bytes:
        data = bytes(data)
    return int(google_crc32c.value(data))


def digest_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """The 4-byte wire form (little-endian) of :func:`crc32c`."""
    return _DIGEST.pack(crc32c(data))


# --- SGL, SQE, CQE -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SglDescriptor:
    """A 16-byte SGL descriptor: address u64, length u32, 3 reserved bytes, identifier byte."""

    address: int = 0
    length: int = 0
    sgl_id: int = SGL_TRANSPORT_DATA_BLOCK

    _S: ClassVar[struct.Struct] = struct.Struct("<QI3xB")

    def encode(self) -> bytes:
        return self._S.pack(self.address, self.length, self.sgl_id)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> SglDescriptor:
        address, length, sgl_id = cls._S.unpack(raw)
        return cls(address, length, sgl_id)

    @classmethod
    def in_capsule(cls, length: int, offset: int = 0) -> SglDescriptor:
        return cls(offset, length, SGL_DATA_BLOCK_OFFSET)

    @classmethod
    def transport(cls, length: int) -> SglDescriptor:
        return cls(0, length, SGL_TRANSPORT_DATA_BLOCK)


_SQE = struct.Struct("<BBHIIIQ16s6I")


@dataclass(slots=True)
class Sqe:
    """A 64-byte submission queue entry.

    Fabrics commands (opcode 0x7F) keep FCTYPE in byte 4, which is the low byte of
    ``nsid``; see :attr:`fctype`.
    """

    opcode: int
    cid: int = 0
    nsid: int = 0
    flags: int = SQE_FLAGS_PSDT_SGL
    cdw2: int = 0
    cdw3: int = 0
    mptr: int = 0
    sgl: SglDescriptor = field(default_factory=SglDescriptor)
    cdw10: int = 0
    cdw11: int = 0
    cdw12: int = 0
    cdw13: int = 0
    cdw14: int = 0
    cdw15: int = 0

    SIZE: ClassVar[int] = 64

    def encode(self) -> bytes:
        return _SQE.pack(
            self.opcode, self.flags, self.cid, self.nsid, self.cdw2, self.cdw3, self.mptr,
            self.sgl.encode(), self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14,
            self.cdw15,
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Sqe:
        (opc, flags, cid, nsid, cdw2, cdw3, mptr, sgl, c10, c11, c12, c13, c14,
         c15) = _SQE.unpack(raw)
        return cls(opc, cid, nsid, flags, cdw2, cdw3, mptr, SglDescriptor.decode(sgl),
                   c10, c11, c12, c13, c14, c15)

    @property
    def fctype(self) -> int:
        return self.nsid & 0xFF

    @property
    def slba(self) -> int:
        return self.cdw10 | (self.cdw11 << 32)

    @property
    def nlb(self) -> int:
        """Number of logical blocks (CDW12 bits 15:0 are 0's based)."""
        return (self.cdw12 & 0xFFFF) + 1


_CQE = struct.Struct("<IIHHHH")


def make_status(sc: int, sct: int = 0, *, dnr: bool = False) -> int:
    """The CQE status field (bits 8:1 SC, 11:9 SCT, 15 DNR; phase bit 0 left clear)."""
    return ((sc & 0xFF) << 1) | ((sct & 0x7) << 9) | (0x8000 if dnr else 0)


@dataclass(slots=True)
class Cqe:
    """A 16-byte completion queue entry. ``status`` is the raw 16-bit field."""

    cid: int
    status: int = 0
    dw0: int = 0
    dw1: int = 0
    sqhd: int = 0
    sqid: int = 0

    SIZE: ClassVar[int] = 16

    def encode(self) -> bytes:
        return _CQE.pack(self.dw0, self.dw1, self.sqhd, self.sqid, self.cid, self.status)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Cqe:
        dw0, dw1, sqhd, sqid, cid, status = _CQE.unpack(raw)
        return cls(cid, status, dw0, dw1, sqhd, sqid)

    @property
    def sc(self) -> int:
        return (self.status >> 1) & 0xFF

    @property
    def sct(self) -> int:
        return (self.status >> 9) & 0x7

    @property
    def dnr(self) -> bool:
        return bool(self.status & 0x8000)

    @property
    def ok(self) -> bool:
        return (self.status & 0x0FFE) == 0

    @property
    def result64(self) -> int:
        return self.dw0 | (self.dw1 << 32)


# --- PDUs -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ICReq:
    pfv: int = 0
    hpda: int = 0
    hdgst: bool = False
    ddgst: bool = False
    maxr2t: int = 0
    pdu_type: ClassVar[int] = PduType.ICREQ


@dataclass(frozen=True, slots=True)
class ICResp:
    pfv: int = 0
    cpda: int = 0
    hdgst: bool = False
    ddgst: bool = False
    maxh2cdata: int = 0x400000
    pdu_type: ClassVar[int] = PduType.ICRESP


@dataclass(frozen=True, slots=True)
class CapsuleCmd:
    sqe: Sqe
    data: bytes | memoryview = b""
    pdu_type: ClassVar[int] = PduType.CAPSULE_CMD


@dataclass(frozen=True, slots=True)
class CapsuleResp:
    cqe: Cqe
    pdu_type: ClassVar[int] = PduType.CAPSULE_RESP


@dataclass(frozen=True, slots=True)
class H2CData:
    cccid: int
    ttag: int
    datao: int
    data: bytes | memoryview
    last: bool = True
    pdu_type: ClassVar[int] = PduType.H2C_DATA


@dataclass(frozen=True, slots=True)
class C2HData:
    cccid: int
    datao: int
    data: bytes | memoryview
    last: bool = True
    success: bool = False
    pdu_type: ClassVar[int] = PduType.C2H_DATA


@dataclass(frozen=True, slots=True)
class R2T:
    cccid: int
    ttag: int
    r2to: int
    r2tl: int
    pdu_type: ClassVar[int] = PduType.R2T


@dataclass(frozen=True, slots=True)
class TermReq:
    """H2CTermReq (``h2c=True``) or C2HTermReq: FES, FEI and up to 128 header bytes."""

    h2c: bool
    fes: int
    fei: int = 0
    error_header: bytes = b""

    @property
    def pdu_type(self) -> int:
        return PduType.H2C_TERM_REQ if self.h2c else PduType.C2H_TERM_REQ


Pdu = ICReq | ICResp | CapsuleCmd | CapsuleResp | H2CData | C2HData | R2T | TermReq


# --- encoding ---------------------------------------------------------------------------------


def encode_parts(
    pdu: Pdu, *, hdgst: bool = False, ddgst: bool = False
) -> list[bytes | memoryview]:
    """Encode ``pdu`` as a list of buffers to write in order (data is not copied).

    ``hdgst``/``ddgst`` are the digests negotiated on the connection; they are applied only
    to PDU types they apply to.
    """
    ptype = pdu.pdu_type
    hlen = HLEN[ptype]
    if ptype in _TERM_TYPES:
        assert isinstance(pdu, TermReq)
        err = bytes(pdu.error_header[:TERM_MAX_ERROR_HEADER])
        plen = hlen + len(err)
        return [_CH.pack(ptype, 0, hlen, 0, plen) + _TERM_HDR.pack(pdu.fes, pdu.fei) + err]
    if ptype == PduType.ICREQ:
        assert isinstance(pdu, ICReq)
        dg = (1 if pdu.hdgst else 0) | (2 if pdu.ddgst else 0)
        body = _ICREQ.pack(pdu.pfv, pdu.hpda, dg, pdu.maxr2t)
        return [_CH.pack(ptype, 0, 128, 0, 128) + body + bytes(128 - 8 - len(body))]
    if ptype == PduType.ICRESP:
        assert isinstance(pdu, ICResp)
        dg = (1 if pdu.hdgst else 0) | (2 if pdu.ddgst else 0)
        body = _ICRESP.pack(pdu.pfv, pdu.cpda, dg, pdu.maxh2cdata)
        return [_CH.pack(ptype, 0, 128, 0, 128) + body + bytes(128 - 8 - len(body))]

    flags = FLAG_HDGSTF if hdgst else 0
    data: bytes | memoryview = b""
    if isinstance(pdu, CapsuleCmd):
        specific = pdu.sqe.encode()
        data = pdu.data
    elif isinstance(pdu, CapsuleResp):
        specific = pdu.cqe.encode()
    elif isinstance(pdu, H2CData):
        data = pdu.data
        specific = _DATA_HDR.pack(pdu.cccid, pdu.ttag, pdu.datao, len(data))
        if pdu.last:
            flags |= FLAG_LAST_PDU
    elif isinstance(pdu, C2HData):
        data = pdu.data
        specific = _DATA_HDR.pack(pdu.cccid, 0, pdu.datao, len(data))
        if pdu.last:
            flags |= FLAG_LAST_PDU
        if pdu.success:
            if not pdu.last:
                raise ValueError("C2HData SUCCESS requires LAST_PDU")
            flags |= FLAG_SUCCESS
    elif isinstance(pdu, R2T):
        specific = _R2T_HDR.pack(pdu.cccid, pdu.ttag, pdu.r2to, pdu.r2tl)
    else:  # pragma: no cover - exhaustive over Pdu
        raise TypeError(f"not a PDU: {pdu!r}")
    datalen = len(data)
    hd = DIGEST_LEN if hdgst else 0
    dd = DIGEST_LEN if (ddgst and datalen) else 0
    if dd:
        flags |= FLAG_DDGSTF
    pdo = hlen + hd if datalen else 0
    plen = hlen + hd + datalen + dd
    header = _CH.pack(ptype, flags, hlen, pdo, plen) + specific
    if hd:
        header += digest_bytes(header)
    if not datalen:
        return [header]
    if dd:
        return [header, data, digest_bytes(data)]
    return [header, data]


def encode(pdu: Pdu, *, hdgst: bool = False, ddgst: bool = False) -> bytes:
    """Encode ``pdu`` into one ``bytes`` object (see :func:`encode_parts`)."""
    return b"".join(bytes(p) if isinstance(p, memoryview) else p
                    for p in encode_parts(pdu, hdgst=hdgst, ddgst=ddgst))


# --- the I/O hot path: Read/Write capsules, CapsuleResp and C2HData without digests -----------
#
# What encode_parts/decode_header do for these PDUs, in one struct call each: at 4 KiB the
# host's generic path (dataclasses, layout checks, two header reads) cost about as much as
# the whole command did on the wire (BENCHMARKS.md). Anything not in exactly the canonical
# form goes through the generic path, which decides what is malformed.

_IO_CAPSULE = struct.Struct("<BBBBIBBHIIIQQI3xBIIIIII")  # common header + SQE: 72 bytes


def encode_io_capsule(opcode: int, cid: int, nsid: int, slba: int, nlb: int,
                      in_capsule: int, transfer: int) -> bytes:
    """The 72-byte header of a Read/Write CapsuleCmd on a queue without header digest:
    ``in_capsule`` data bytes follow it (SGL Data Block, offset 0), or ``transfer`` bytes
    move in data PDUs (Transport SGL). Equals the header :func:`encode_parts` makes."""
    if in_capsule:
        return _IO_CAPSULE.pack(PduType.CAPSULE_CMD, 0, 72, 72, 72 + in_capsule, opcode,
                                SQE_FLAGS_PSDT_SGL, cid, nsid, 0, 0, 0, 0, in_capsule,
                                SGL_DATA_BLOCK_OFFSET, slba & 0xFFFFFFFF, slba >> 32,
                                (nlb - 1) & 0xFFFF, 0, 0, 0)
    return _IO_CAPSULE.pack(PduType.CAPSULE_CMD, 0, 72, 0, 72, opcode, SQE_FLAGS_PSDT_SGL,
                            cid, nsid, 0, 0, 0, 0, transfer, SGL_TRANSPORT_DATA_BLOCK,
                            slba & 0xFFFFFFFF, slba >> 32, (nlb - 1) & 0xFFFF, 0, 0, 0)


def decode_hot_resp(buf: bytes | bytearray | memoryview, pos: int) -> Cqe | None:
    """The CQE of the 24-byte CapsuleResp at ``buf[pos:]`` (no header digest), or None
    when the header is not exactly that PDU's (let :func:`decode_common` judge it)."""
    ptype, flags, hlen, pdo, plen = _CH.unpack_from(buf, pos)
    if ptype != PduType.CAPSULE_RESP or flags or hlen != 24 or pdo or plen != 24:
        return None
    dw0, dw1, sqhd, sqid, cid, st = _CQE.unpack_from(buf, pos + 8)
    return Cqe(cid, st, dw0, dw1, sqhd, sqid)


def decode_hot_c2h(buf: bytes | bytearray | memoryview, pos: int
                   ) -> tuple[int, int, int, bool] | None:
    """(CCCID, DATAO, DATAL, SUCCESS) of the C2HData header at ``buf[pos:]`` on a queue
    without digests, or None when it is not exactly a well-formed one."""
    ptype, flags, hlen, pdo, plen = _CH.unpack_from(buf, pos)
    if (ptype != PduType.C2H_DATA or hlen != 24 or pdo != 24 or plen <= 24
            or flags & ~(FLAG_LAST_PDU | FLAG_SUCCESS)
            or (flags & FLAG_SUCCESS and not flags & FLAG_LAST_PDU)):
        return None
    cccid, _ttag, datao, datal = _DATA_HDR.unpack_from(buf, pos + 8)
    if datal != plen - 24:
        return None
    return cccid, datao, datal, bool(flags & FLAG_SUCCESS)


# The target's side of the same hot path: Read/Write CapsuleCmd headers in, C2HData
# headers and CapsuleResps out (emulator/nvmetcp/connection.py; BENCHMARKS.md, issue 40).

_HOT_CAPSULE = struct.Struct("<BBBBIBBHI16xQI3xBIII12x")  # the fields a Read/Write uses
_HOT_RESP = struct.Struct("<BBBBIIIHHHH")  # CapsuleResp, no header digest: 24 bytes
_HOT_C2H = struct.Struct("<BBBBIHHII4x")  # C2HData header, no digests: 24 bytes


def decode_hot_capsule(buf: bytes | bytearray | memoryview, pos: int
                       ) -> tuple[int, int, int, int, int, int, int, int] | None:
    """(OPCODE, CID, NSID, SLBA, NLB, CDW12, in-capsule bytes, SGL length) of the
    CapsuleCmd header at ``buf[pos:]`` (72 bytes there) on a queue without digests, or
    None when it is not exactly the canonical form of a command with a data pointer:
    no flags, PSDT SGL and no fused bits, and either no data and a Transport SGL with a
    length, or in-capsule data with a Data Block (offset 0) SGL covering all of it. What
    is not canonical goes through :func:`decode_common`, which judges it."""
    (ptype, flags, hlen, pdo, plen, opc, sflags, cid, nsid, addr, length, sgl_id, c10, c11,
     c12) = _HOT_CAPSULE.unpack_from(buf, pos)
    if ptype != PduType.CAPSULE_CMD or flags or hlen != 72 or sflags != SQE_FLAGS_PSDT_SGL:
        return None
    if pdo == 0:
        if plen != 72 or sgl_id != SGL_TRANSPORT_DATA_BLOCK or not length:
            return None
        return opc, cid, nsid, c10 | (c11 << 32), (c12 & 0xFFFF) + 1, c12, 0, length
    if (pdo != 72 or plen <= 72 or sgl_id != SGL_DATA_BLOCK_OFFSET or addr
            or length != plen - 72):
        return None
    return opc, cid, nsid, c10 | (c11 << 32), (c12 & 0xFFFF) + 1, c12, length, length


def encode_hot_resp(cid: int, sqhd: int, sqid: int) -> bytes:
    """A successful CapsuleResp (DW0 = DW1 = 0) on a queue without header digest;
    equals what :func:`encode_parts` makes of ``CapsuleResp(Cqe(cid, 0, 0, 0, sqhd, sqid))``."""
    return _HOT_RESP.pack(PduType.CAPSULE_RESP, 0, 24, 0, 24, 0, 0, sqhd, sqid, cid, 0)


def encode_hot_c2h(cid: int, datal: int, success: bool) -> bytes:
    """The header of a C2HData carrying a whole transfer (DATAO 0, LAST_PDU; SUCCESS when
    asked) on a queue without digests; equals :func:`encode_parts`'s."""
    flags = FLAG_LAST_PDU | FLAG_SUCCESS if success else FLAG_LAST_PDU
    return _HOT_C2H.pack(PduType.C2H_DATA, flags, 24, 24, 24 + datal, cid, 0, 0, datal)


# --- decoding ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CommonHeader:
    pdu_type: int
    flags: int
    hlen: int
    pdo: int
    plen: int

    SIZE: ClassVar[int] = 8


def decode_common(raw: bytes | bytearray | memoryview) -> CommonHeader:
    """Decode and sanity-check the 8-byte common header (type and HLEN known, PLEN ≥ HLEN)."""
    ptype, flags, hlen, pdo, plen = _CH.unpack_from(raw, 0)
    if ptype not in HLEN:
        raise PduError(f"unknown PDU type {ptype:#04x}", fei=0)
    if hlen != HLEN[ptype]:
        raise PduError(f"PDU type {ptype:#04x}: HLEN {hlen}, expected {HLEN[ptype]}", fei=2)
    if plen < hlen:
        raise PduError(f"PLEN {plen} is smaller than HLEN {hlen}", fei=4)
    return CommonHeader(ptype, flags, hlen, pdo, plen)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the parts of a PDU lie, from its common header and the negotiated digests."""

    header_len: int  # HLEN + header digest: bytes to read before the data
    data_offset: int  # PDO (0 when there is no data)
    data_len: int
    ddgst_len: int


def layout(
    ch: CommonHeader, *, hdgst: bool, ddgst: bool, max_data: int
) -> Layout:
    """Check the digest flags, PDO and PLEN of ``ch``; return the PDU's layout.

    ``max_data`` bounds the data a PDU may carry (so a receiver never buffers more).
    """
    ptype = ch.pdu_type
    if ptype in (PduType.ICREQ, PduType.ICRESP) or ptype in _TERM_TYPES:
        if ch.flags & (FLAG_HDGSTF | FLAG_DDGSTF):
            raise PduError("digest flags set on a PDU that never carries digests", fei=1)
        if ptype in _TERM_TYPES:
            if ch.plen > ch.hlen + TERM_MAX_ERROR_HEADER:
                raise PduError(f"TermReq PLEN {ch.plen} exceeds {ch.hlen + 128}", fei=4)
            if ch.pdo != 0:
                raise PduError("TermReq with a PDO", fei=3)
            return Layout(ch.hlen, ch.hlen, ch.plen - ch.hlen, 0)
        if ch.plen != 128 or ch.pdo != 0:
            raise PduError(f"ICReq/ICResp PLEN {ch.plen} PDO {ch.pdo}, expected 128/0",
                           fei=4 if ch.plen != 128 else 3)
        return Layout(128, 0, 0, 0)
    want_hd = hdgst and ptype in _HDGST_TYPES
    if bool(ch.flags & FLAG_HDGSTF) != want_hd:
        raise PduError("header digest flag does not match the negotiated digest", fei=1)
    hd = DIGEST_LEN if want_hd else 0
    header_len = ch.hlen + hd
    if ptype not in _DATA_TYPES:
        if ch.flags & FLAG_DDGSTF or ch.pdo != 0 or ch.plen != header_len:
            raise PduError(f"PDU type {ptype:#04x} carries no data (PLEN {ch.plen}, "
                           f"expected {header_len})", fei=4)
        return Layout(header_len, 0, 0, 0)
    if ch.plen == header_len:
        if ch.pdo != 0 or ch.flags & FLAG_DDGSTF:
            raise PduError("PDO or DDGSTF set on a PDU without data", fei=3)
        if ptype != PduType.CAPSULE_CMD:
            raise PduError("data PDU without data", fei=4)
        return Layout(header_len, 0, 0, 0)
    if ch.pdo < header_len or ch.pdo % 4 or ch.pdo > ch.plen:
        raise PduError(f"PDO {ch.pdo} out of place (header ends at {header_len})", fei=3)
    want_dd = ddgst
    if bool(ch.flags & FLAG_DDGSTF) != want_dd:
        raise PduError("data digest flag does not match the negotiated digest", fei=1)
    dd = DIGEST_LEN if want_dd else 0
    data_len = ch.plen - ch.pdo - dd
    if data_len <= 0:
        raise PduError(f"PLEN {ch.plen} leaves no room for data after PDO {ch.pdo}", fei=4)
    if data_len > max_data:
        raise PduError(f"PDU carries {data_len} data bytes, limit {max_data}",
                       fes=FES_DATA_LIMIT_EXCEEDED, fei=4)
    return Layout(header_len, ch.pdo, data_len, dd)


def decode_header(
    ch: CommonHeader, header: bytes | bytearray | memoryview, lay: Layout
) -> Pdu:
    """Decode a PDU's header (``header`` holds at least ``lay.header_len`` bytes).

    Checks the header digest. For data PDUs the returned object's ``data`` is empty and
    the caller attaches the ``lay.data_len`` data bytes (see :func:`attach_data`).
    """
    ptype = ch.pdu_type
    if lay.header_len > ch.hlen:
        want = _DIGEST.unpack_from(header, ch.hlen)[0]
        if crc32c(bytes(header[: ch.hlen])) != want:
            raise PduError("header digest mismatch", fes=FES_HEADER_DIGEST_ERROR, fei=ch.hlen)
    if ptype == PduType.ICREQ:
        pfv, hpda, dg, maxr2t = _ICREQ.unpack_from(header, 8)
        return ICReq(pfv, hpda, bool(dg & 1), bool(dg & 2), maxr2t)
    if ptype == PduType.ICRESP:
        pfv, cpda, dg, maxdata = _ICRESP.unpack_from(header, 8)
        return ICResp(pfv, cpda, bool(dg & 1), bool(dg & 2), maxdata)
    if ptype in _TERM_TYPES:
        fes, fei = _TERM_HDR.unpack_from(header, 8)
        return TermReq(ptype == PduType.H2C_TERM_REQ, fes, fei, b"")
    if ptype == PduType.CAPSULE_CMD:
        return CapsuleCmd(Sqe.decode(bytes(header[8:72])))
    if ptype == PduType.CAPSULE_RESP:
        return CapsuleResp(Cqe.decode(bytes(header[8:24])))
    if ptype == PduType.R2T:
        cccid, ttag, r2to, r2tl = _R2T_HDR.unpack_from(header, 8)
        if ch.flags & ~FLAG_HDGSTF:
            raise PduError("R2T with unexpected flags", fei=1)
        return R2T(cccid, ttag, r2to, r2tl)
    cccid, ttag, datao, datal = _DATA_HDR.unpack_from(header, 8)
    if datal != lay.data_len:
        raise PduError(f"DATAL {datal} does not match the {lay.data_len} data bytes carried",
                       fei=16)
    last = bool(ch.flags & FLAG_LAST_PDU)
    if ptype == PduType.H2C_DATA:
        if ch.flags & FLAG_SUCCESS:
            raise PduError("SUCCESS flag on H2CData", fei=1)
        return H2CData(cccid, ttag, datao, b"", last)
    success = bool(ch.flags & FLAG_SUCCESS)
    if success and not last:
        raise PduError("C2HData SUCCESS without LAST_PDU", fei=1)
    return C2HData(cccid, datao, b"", last, success)


def check_data_digest(data: bytes | bytearray | memoryview, digest: bytes | memoryview,
                      *, fei: int = 0) -> None:
    if crc32c(data) != _DIGEST.unpack(digest)[0]:
        # A data digest error is not fatal in the spec (the command fails with Data Transfer
        # Error); callers decide. Header offset 0 = the PDU as a whole.
        raise PduError("data digest mismatch", fes=FES_HEADER_DIGEST_ERROR, fei=fei)


def attach_data(pdu: Pdu, data: bytes | memoryview) -> Pdu:
    """Return ``pdu`` with its data (for CapsuleCmd, H2CData, C2HData) or error header."""
    if isinstance(pdu, CapsuleCmd):
        return CapsuleCmd(pdu.sqe, data)
    if isinstance(pdu, H2CData):
        return H2CData(pdu.cccid, pdu.ttag, pdu.datao, data, pdu.last)
    if isinstance(pdu, C2HData):
        return C2HData(pdu.cccid, pdu.datao, data, pdu.last, pdu.success)
    if isinstance(pdu, TermReq):
        return TermReq(pdu.h2c, pdu.fes, pdu.fei, bytes(data))
    return pdu


class PduParser:
    """Incremental PDU framer: feed bytes, iterate complete PDUs.

    ``hdgst``/``ddgst`` may be changed once ICReq/ICResp negotiated them. Raises
    :class:`PduError` on the first malformed PDU; after that the stream is unusable
    (the connection must be terminated). ``max_data`` bounds buffered data per PDU.
    A data-digest mismatch raises :class:`DataDigestError` after the whole PDU was
    consumed, so a target may fail just that command.
    """

    def __init__(self, *, max_data: int, hdgst: bool = False, ddgst: bool = False) -> None:
        self.max_data = max_data
        self.hdgst = hdgst
        self.ddgst = ddgst
        self._buf = bytearray()
        self.last_header: bytes = b""

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def __iter__(self) -> Iterator[Pdu]:
        return self

    def __next__(self) -> Pdu:
        pdu = self.next_pdu()
        if pdu is None:
            raise StopIteration
        return pdu

    def next_pdu(self) -> Pdu | None:
        buf = self._buf
        if len(buf) < 8:
            return None
        self.last_header = bytes(buf[:8])
        ch = decode_common(buf)
        lay = layout(ch, hdgst=self.hdgst, ddgst=self.ddgst, max_data=self.max_data)
        if len(buf) < ch.plen:
            return None
        self.last_header = bytes(buf[: min(ch.hlen, TERM_MAX_ERROR_HEADER)])
        pdu = decode_header(ch, buf, lay)
        if lay.data_len:
            start = lay.data_offset
            data = bytes(buf[start: start + lay.data_len])
            if lay.ddgst_len:
                digest = bytes(buf[start + lay.data_len: start + lay.data_len + DIGEST_LEN])
                if crc32c(data) != _DIGEST.unpack(digest)[0]:
                    del buf[: ch.plen]
                    raise DataDigestError(attach_data(pdu, data))
            pdu = attach_data(pdu, data)
        del buf[: ch.plen]
        return pdu


class DataDigestError(PduError):
    """A complete PDU whose data digest did not match; ``pdu`` is the PDU (data attached)."""

    def __init__(self, pdu: Pdu) -> None:
        super().__init__("data digest mismatch", fes=FES_HEADER_DIGEST_ERROR, fei=0)
        self.pdu = pdu
