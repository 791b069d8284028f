"""PDU codec: golden bytes (hand-assembled from the spec tables in docs/nvme-tcp.md),
hypothesis round trips with and without digests, and malformed-header rejection."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.nvme import pdu as P

H = bytes.fromhex


def crc_le(data: bytes) -> bytes:
    return struct.pack("<I", P.crc32c(data))


def test_crc32c_check_value() -> None:
    assert P.crc32c(b"123456789") == 0xE3069283
    assert P.digest_bytes(b"123456789") == H("83 92 06 e3")
    assert P.crc32c(memoryview(bytearray(b"123456789"))) == 0xE3069283


def test_icreq_golden() -> None:
    assert P.encode(P.ICReq()) == H("00 00 80 00 80 00 00 00") + bytes(120)
    raw = P.encode(P.ICReq(hdgst=True, ddgst=True))
    assert raw[:16] == H("00 00 80 00 80 00 00 00  00 00 00 03 00 00 00 00")
    assert len(raw) == 128 and raw[16:] == bytes(112)


def test_icresp_golden() -> None:
    raw = P.encode(P.ICResp(cpda=0, hdgst=True, ddgst=False, maxh2cdata=0x400000))
    assert raw[:16] == H("01 00 80 00 80 00 00 00  00 00 00 01 00 00 40 00")
    assert raw[16:] == bytes(112)


def identify_sqe() -> P.Sqe:
    return P.Sqe(0x06, cid=0x1234, nsid=1, sgl=P.SglDescriptor.transport(4096), cdw10=1)


SQE_IDENTIFY = H(
    "06 40 34 12 01 00 00 00  00 00 00 00 00 00 00 00"  # opc, PSDT=01b, cid, nsid, cdw2/3
    "00 00 00 00 00 00 00 00"                           # MPTR
    "00 00 00 00 00 00 00 00  00 10 00 00 00 00 00 5a"  # SGL1: addr, len 4096, id 0x5A
    "01 00 00 00" + "00" * 20                            # CDW10 = CNS 1
)


def test_capsule_cmd_golden() -> None:
    assert len(SQE_IDENTIFY) == 64
    assert identify_sqe().encode() == SQE_IDENTIFY
    assert P.encode(P.CapsuleCmd(identify_sqe())) == H("04 00 48 00 48 00 00 00") + SQE_IDENTIFY
    with_hd = P.encode(P.CapsuleCmd(identify_sqe()), hdgst=True, ddgst=True)
    header = H("04 01 48 00 4c 00 00 00") + SQE_IDENTIFY
    assert with_hd == header + crc_le(header)  # no data, so no data digest


def test_capsule_cmd_in_capsule_golden() -> None:
    data = b"\xaa" * 8
    sqe = P.Sqe(0x01, cid=2, nsid=1, sgl=P.SglDescriptor.in_capsule(8))
    raw = P.encode(P.CapsuleCmd(sqe, data), hdgst=True, ddgst=True)
    # flags HDGSTF|DDGSTF, HLEN 72, PDO 76, PLEN 72+4+8+4 = 88
    assert raw[:8] == H("04 03 48 4c 58 00 00 00")
    assert raw[8 + 24: 8 + 40] == H("00 00 00 00 00 00 00 00  08 00 00 00 00 00 00 01")
    assert raw[72:76] == crc_le(raw[:72])
    assert raw[76:84] == data and raw[84:] == crc_le(data)


def test_capsule_resp_and_status_golden() -> None:
    cqe = P.Cqe(cid=7, status=0, dw0=1, sqhd=2, sqid=1)
    assert P.encode(P.CapsuleResp(cqe)) == H(
        "05 00 18 00 18 00 00 00  01 00 00 00 00 00 00 00  02 00 01 00 07 00 00 00")
    assert P.make_status(0x84, 1, dnr=True) == 0x8308  # Connect Invalid Host, DNR
    err = P.Cqe(cid=1, status=0x8308)
    assert (err.sct, err.sc, err.dnr, err.ok) == (1, 0x84, True, False)


def test_h2c_data_golden() -> None:
    pdu = P.H2CData(cccid=3, ttag=5, datao=0x1000, data=b"abcd", last=True)
    assert P.encode(pdu) == H(
        "06 04 18 18 1c 00 00 00  03 00 05 00 00 10 00 00  04 00 00 00 00 00 00 00 61 62 63 64")
    raw = P.encode(pdu, hdgst=True, ddgst=True)
    assert raw[:8] == H("06 07 18 1c 24 00 00 00")
    assert raw[24:28] == crc_le(raw[:24]) and raw[28:32] == b"abcd"
    assert raw[32:] == crc_le(b"abcd")


def test_c2h_data_golden_success_flag() -> None:
    raw = P.encode(P.C2HData(cccid=9, datao=0, data=b"\x01\x02\x03\x04", last=True,
                             success=True))
    assert raw == H("07 0c 18 18 1c 00 00 00  09 00 00 00 00 00 00 00  04 00 00 00 00 00 00 00"
                    "01 02 03 04")
    with pytest.raises(ValueError):
        P.encode(P.C2HData(9, 0, b"1234", last=False, success=True))


def test_r2t_golden() -> None:
    assert P.encode(P.R2T(cccid=4, ttag=4, r2to=0, r2tl=0x20000)) == H(
        "09 00 18 00 18 00 00 00  04 00 04 00 00 00 00 00  00 00 02 00 00 00 00 00")


def test_term_req_golden() -> None:
    bad = H("04 00 48 00 ff ff 00 00")
    raw = P.encode(P.TermReq(h2c=False, fes=P.FES_INVALID_HEADER_FIELD, fei=4, error_header=bad))
    assert raw == H("03 00 18 00 20 00 00 00  01 00 04 00 00 00") + bytes(10) + bad
    h2c = P.encode(P.TermReq(h2c=True, fes=2, error_header=bytes(300)))
    assert h2c[0] == 0x02 and len(h2c) == 24 + 128  # at most 128 header bytes


def test_connect_data_offsets() -> None:
    from kvtool.nvme.spec import ConnectData

    raw = ConnectData(b"\x11" * 16, 0xFFFF, "nqn.2026-01.io.kvtool:sub", "nqn.2026-01.io.kvtool:h").encode()
    assert len(raw) == 1024
    assert raw[:16] == b"\x11" * 16 and raw[16:18] == H("ff ff")
    assert raw[256:281] == b"nqn.2026-01.io.kvtool:sub" and raw[281] == 0
    assert raw[512:535] == b"nqn.2026-01.io.kvtool:h"
    assert ConnectData.decode(raw).subnqn == "nqn.2026-01.io.kvtool:sub"


# --- hypothesis round trips ------------------------------------------------------------

u8, u16, u32, u64 = (st.integers(0, 2**n - 1) for n in (8, 16, 32, 64))
payload = st.binary(min_size=1, max_size=600)

sgls = st.builds(P.SglDescriptor, address=u64, length=u32, sgl_id=u8)
sqes = st.builds(P.Sqe, opcode=u8, cid=u16, nsid=u32, flags=u8, cdw2=u32, cdw3=u32, mptr=u64,
                 sgl=sgls, cdw10=u32, cdw11=u32, cdw12=u32, cdw13=u32, cdw14=u32, cdw15=u32)
cqes = st.builds(P.Cqe, cid=u16, status=u16, dw0=u32, dw1=u32, sqhd=u16, sqid=u16)

pdus = st.one_of(
    st.builds(P.ICReq, pfv=u16, hpda=u8, hdgst=st.booleans(), ddgst=st.booleans(), maxr2t=u32),
    st.builds(P.ICResp, pfv=u16, cpda=u8, hdgst=st.booleans(), ddgst=st.booleans(),
              maxh2cdata=u32),
    st.builds(P.CapsuleCmd, sqe=sqes, data=st.binary(max_size=600)),
    st.builds(P.CapsuleResp, cqe=cqes),
    st.builds(P.H2CData, cccid=u16, ttag=u16, datao=u32, data=payload, last=st.booleans()),
    st.builds(lambda c, o, d, last, s: P.C2HData(c, o, d, last or s, s),
              u16, u32, payload, st.booleans(), st.booleans()),
    st.builds(P.R2T, cccid=u16, ttag=u16, r2to=u32, r2tl=u32),
    st.builds(P.TermReq, h2c=st.booleans(), fes=u16, fei=u32,
              error_header=st.binary(max_size=128)),
)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(pdus=st.lists(pdus, min_size=1, max_size=4), hd=st.booleans(), dd=st.booleans(),
       chunk=st.integers(1, 200))
def test_round_trip(pdus: list[P.Pdu], hd: bool, dd: bool, chunk: int) -> None:
    stream = b"".join(P.encode(p, hdgst=hd, ddgst=dd) for p in pdus)
    parser = P.PduParser(max_data=1 << 16, hdgst=hd, ddgst=dd)
    got: list[P.Pdu] = []
    for i in range(0, len(stream), chunk):
        parser.feed(stream[i: i + chunk])
        got.extend(parser)
    assert got == pdus
    assert parser.buffered == 0


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(raw=st.binary(min_size=8, max_size=300), hd=st.booleans(), dd=st.booleans())
def test_arbitrary_bytes_raise_only_pdu_error(raw: bytes, hd: bool, dd: bool) -> None:
    parser = P.PduParser(max_data=4096, hdgst=hd, ddgst=dd)
    parser.feed(raw)
    try:
        list(parser)
    except P.PduError as exc:
        assert 1 <= exc.fes <= 6


@pytest.mark.parametrize(("mutate", "fes", "fei"), [
    (lambda b: b[:0] + b"\x08" + b[1:], P.FES_INVALID_HEADER_FIELD, 0),   # unknown type
    (lambda b: b[:2] + b"\x49" + b[3:], P.FES_INVALID_HEADER_FIELD, 2),   # HLEN
    (lambda b: b[:4] + struct.pack("<I", 10) + b[8:], P.FES_INVALID_HEADER_FIELD, 4),  # PLEN<HLEN
    (lambda b: b[:1] + b"\x01" + b[2:], P.FES_INVALID_HEADER_FIELD, 1),   # HDGSTF not negotiated
])
def test_malformed_headers_name_the_field(mutate, fes: int, fei: int) -> None:  # type: ignore[no-untyped-def]
    good = P.encode(P.CapsuleCmd(identify_sqe()))
    parser = P.PduParser(max_data=8192)
    parser.feed(mutate(good))
    with pytest.raises(P.PduError) as info:
        parser.next_pdu()
    assert (info.value.fes, info.value.fei) == (fes, fei)


def test_header_digest_mismatch_is_fes_3() -> None:
    raw = bytearray(P.encode(P.CapsuleResp(P.Cqe(cid=1)), hdgst=True))
    raw[10] ^= 0xFF
    parser = P.PduParser(max_data=0, hdgst=True)
    parser.feed(bytes(raw))
    with pytest.raises(P.PduError) as info:
        parser.next_pdu()
    assert info.value.fes == P.FES_HEADER_DIGEST_ERROR


def test_data_digest_mismatch_keeps_stream_in_sync() -> None:
    bad = bytearray(P.encode(P.H2CData(1, 1, 0, b"x" * 64), ddgst=True))
    bad[-1] ^= 1
    good = P.encode(P.R2T(1, 1, 0, 64), ddgst=True)
    parser = P.PduParser(max_data=4096, ddgst=True)
    parser.feed(bytes(bad) + good)
    with pytest.raises(P.DataDigestError) as info:
        parser.next_pdu()
    assert isinstance(info.value.pdu, P.H2CData) and info.value.pdu.data == b"x" * 64
    assert parser.next_pdu() == P.R2T(1, 1, 0, 64)


def test_data_limit_is_enforced_before_buffering() -> None:
    hdr = P.encode(P.H2CData(1, 1, 0, b"y" * 8192))[:24]
    parser = P.PduParser(max_data=4096)
    parser.feed(hdr)  # only the header: the limit is checked before the data arrives
    with pytest.raises(P.PduError) as info:
        parser.next_pdu()
    assert info.value.fes == P.FES_DATA_LIMIT_EXCEEDED


# --- the I/O hot path agrees with the generic codec --------------------------------------


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(opcode=st.sampled_from([0x01, 0x02]), cid=u16, nsid=u32, slba=u64,
       nlb=st.integers(1, 65536), in_capsule=st.integers(0, 1 << 20),
       transfer=st.integers(1, 1 << 24))
def test_io_capsule_equals_generic_encoding(opcode: int, cid: int, nsid: int, slba: int,
                                            nlb: int, in_capsule: int, transfer: int) -> None:
    sqe = P.Sqe(opcode, cid=cid, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                cdw12=(nlb - 1) & 0xFFFF)
    if in_capsule:
        sqe.sgl = P.SglDescriptor.in_capsule(in_capsule)
        want = P.encode_parts(P.CapsuleCmd(sqe, bytes(in_capsule)))[0]
    else:
        sqe.sgl = P.SglDescriptor.transport(transfer)
        want = P.encode_parts(P.CapsuleCmd(sqe))[0]
    assert P.encode_io_capsule(opcode, cid, nsid, slba, nlb, in_capsule, transfer) == want


def _generic(raw: bytes) -> P.Pdu | None:
    """What the generic decoder makes of a header on a queue without digests."""
    try:
        ch = P.decode_common(raw)
        lay = P.layout(ch, hdgst=False, ddgst=False, max_data=1 << 31)
        return P.decode_header(ch, raw[:lay.header_len], lay)
    except P.PduError:
        return None


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(cqe=cqes, c2h=st.tuples(u16, u32, st.integers(1, 1 << 20), st.booleans(),
                               st.booleans()),
       flips=st.lists(st.tuples(st.integers(0, 23), st.integers(1, 255)), max_size=2))
def test_hot_decoders_agree_with_the_generic_path(cqe: P.Cqe, c2h: tuple[int, int, int, bool,
                                                                         bool],
                                                  flips: list[tuple[int, int]]) -> None:
    """Canonical CapsuleResp / C2HData headers decode the same both ways; any header the
    hot path accepts after corruption is one the generic path accepts with equal fields
    (everything else falls through to the generic path and its errors)."""
    cccid, datao, n, last, success = c2h
    c2h_pdu = P.C2HData(cccid, datao, bytes(n), last or success, success)
    for raw in (P.encode(P.CapsuleResp(cqe)), P.encode_parts(c2h_pdu)[0]):
        mutated = bytearray(raw)
        for pos, xor in flips:
            mutated[pos] ^= xor
        for header in (bytes(raw), bytes(mutated)):
            generic = _generic(header)
            hot_resp = P.decode_hot_resp(header, 0)
            hot_c2h = P.decode_hot_c2h(header, 0)
            if hot_resp is not None:
                assert isinstance(generic, P.CapsuleResp) and generic.cqe == hot_resp
            if hot_c2h is not None:
                assert isinstance(generic, P.C2HData)
                assert (generic.cccid, generic.datao, generic.success) == \
                    (hot_c2h[0], hot_c2h[1], hot_c2h[3])
                assert hot_c2h[2] == struct.unpack_from("<I", header, 4)[0] - 24
        assert P.decode_hot_resp(P.encode(P.CapsuleResp(cqe)), 0) == cqe
        assert P.decode_hot_c2h(P.encode_parts(c2h_pdu)[0], 0) == (cccid, datao, n, success)


@pytest.mark.parametrize("byte", [0, 1, 2, 3])
def test_hot_decoders_take_only_what_the_generic_path_takes(byte: int) -> None:
    """Every value of each common-header byte (type, flags, HLEN, PDO) on both PDUs."""
    resp = P.encode(P.CapsuleResp(P.Cqe(7, 0, 1, 2, 3, 1)))
    c2h = P.encode_parts(P.C2HData(7, 4096, bytes(8192), last=True, success=True))[0]
    for raw in (resp, c2h):
        for value in range(256):
            header = raw[:byte] + bytes([value]) + raw[byte + 1:]
            generic = _generic(header)
            if P.decode_hot_resp(header, 0) is not None:
                assert isinstance(generic, P.CapsuleResp)
            hot = P.decode_hot_c2h(header, 0)
            if hot is not None:
                assert isinstance(generic, P.C2HData)
                assert hot == (generic.cccid, generic.datao, 8192, generic.success)
