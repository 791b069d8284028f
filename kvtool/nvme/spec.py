"""NVMe and NVMe-oF constants and data structures (Identify, registers, discovery log).

Shared by kvtool's host and the emulator's target so both read and write the same bytes.
Offsets are those of NVMe base spec 1.4 / NVMe-oF 1.1 as Linux and SPDK use them
(docs/nvme-tcp.md lists them).
"""

from __future__ import annotations

import ipaddress
import re
import struct
from dataclasses import dataclass, field

from kvtool.nvme.pdu import make_status

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
IDENTIFY_DATA_LEN = 4096
CONNECT_DATA_LEN = 1024
ADMIN_IN_CAPSULE_MAX = 8192  # admin queue and fabrics commands (Linux/SPDK)
DISCOVERY_LOG_HEADER = 1024
DISCOVERY_LOG_ENTRY = 1024
NQN_MAX = 223
NQN_FIELD = 256
NQN_FORM = ("nqn.yyyy-mm.<reverse-domain>[:<name>] (or nqn.2014-08.org.nvmexpress:uuid:"
            f"<uuid>), at most {NQN_MAX} bytes")

# NVMe base specification 2.0, §4.7 "NVMe Qualified Names": a date code and a reverse
# domain name, optionally ":" and a string of printable ASCII; or the UUID form.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_NQN_RE = re.compile(rf"nqn\.\d{{4}}-(?:0[1-9]|1[0-2])\.{_LABEL}(?:\.{_LABEL})*"
                     r"(?::[\x21-\x7e][\x20-\x7e]*)?")
_UUID_NQN_RE = re.compile(r"nqn\.2014-08\.org\.nvmexpress:uuid:[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-"
                          r"[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def nqn_problem(nqn: str) -> str | None:
    """Why ``nqn`` is not an NVMe Qualified Name, or ``None`` when it is one.

    The one NQN rule of kvtool's config loader, ``nvme+tcp://`` URLs and the emulator.
    """
    if len(nqn.encode()) > NQN_MAX:
        return f"{nqn[:40]!r}… is {len(nqn.encode())} bytes: an NQN is at most {NQN_MAX}"
    if _NQN_RE.fullmatch(nqn) or _UUID_NQN_RE.fullmatch(nqn):
        return None
    return f"{nqn!r} is not an NQN: expected {NQN_FORM}"


def is_loopback(address: str) -> bool:
    """True for a loopback IP address (or ``localhost``): where a target may listen without
    being told that it may listen elsewhere."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


# Opcodes
OPC_FABRICS = 0x7F
ADMIN_GET_LOG_PAGE = 0x02
ADMIN_IDENTIFY = 0x06
ADMIN_ABORT = 0x08
ADMIN_SET_FEATURES = 0x09
ADMIN_GET_FEATURES = 0x0A
ADMIN_ASYNC_EVENT = 0x0C
ADMIN_KEEP_ALIVE = 0x18
IO_FLUSH = 0x00
IO_WRITE = 0x01
IO_READ = 0x02
IO_WRITE_ZEROES = 0x08
IO_DSM = 0x09

# Fabrics command types
FCTYPE_PROPERTY_SET = 0x00
FCTYPE_CONNECT = 0x01
FCTYPE_PROPERTY_GET = 0x04

# Identify CNS values
CNS_NAMESPACE = 0x00
CNS_CONTROLLER = 0x01
CNS_ACTIVE_NS_LIST = 0x02
CNS_NS_DESC_LIST = 0x03
CNS_CS_CONTROLLER = 0x06

# Features
FID_ARBITRATION = 0x01
FID_POWER_MANAGEMENT = 0x02
FID_TEMPERATURE_THRESHOLD = 0x04
FID_ERROR_RECOVERY = 0x05
FID_VOLATILE_WRITE_CACHE = 0x06
FID_NUMBER_OF_QUEUES = 0x07
FID_WRITE_ATOMICITY = 0x0A
FID_ASYNC_EVENT_CONFIG = 0x0B
FID_KEEP_ALIVE_TIMER = 0x0F
FID_HOST_ID = 0x81

# Identify Controller bits
ONCS_DSM = 1 << 2
ONCS_WRITE_ZEROES = 1 << 3
CTRATT_HOST_ID_128 = 1 << 0
CTRATT_TBKAS = 1 << 6  # traffic based keep alive: any command resets the timer
LPA_PER_NS_SMART = 1 << 0
LPA_EFFECTS = 1 << 1
LPA_EXTENDED = 1 << 2  # NUMDU and LPO in Get Log Page
DLFEAT_READS_ZERO = 0x1  # deallocated blocks read as zeros
DLFEAT_WZ_DEALLOCATE = 1 << 3

# Asynchronous events
AEN_CFG_SMART_WARNINGS = 0x1F  # Async Event Configuration: SMART critical warnings 4:0
AEN_CFG_NS_ATTR = 1 << 8  # Async Event Configuration / OAES: Namespace Attribute Notices
AER_TYPE_NOTICE = 0x2
AER_NOTICE_NS_CHANGED = 0x00
AEN_CFG_ANA_CHANGE = 1 << 11  # Async Event Configuration / OAES: ANA Change Notices
AER_NOTICE_ANA_CHANGE = 0x03

# Asymmetric Namespace Access (NVMe 2.0 base spec 8.1.1; Linux nvmet's ana_state names)
LID_ANA = 0x0C
ANA_LOG_RGO = 1 << 8  # Get Log Page CDW10 LSP bit 0: return groups only (no NSID lists)
CMIC_MULTI_PORT = 1 << 0
CMIC_MULTI_CTRL = 1 << 1
CMIC_ANA = 1 << 3
ANA_OPTIMIZED = 0x1
ANA_NON_OPTIMIZED = 0x2
ANA_INACCESSIBLE = 0x3
ANA_PERSISTENT_LOSS = 0x4
ANA_CHANGE = 0xF
ANA_STATES: dict[str, int] = {"optimized": ANA_OPTIMIZED, "non-optimized": ANA_NON_OPTIMIZED,
                              "inaccessible": ANA_INACCESSIBLE,
                              "persistent-loss": ANA_PERSISTENT_LOSS, "change": ANA_CHANGE}
ANA_STATE_NAMES: dict[int, str] = {v: k for k, v in ANA_STATES.items()}
# ANACAP: every state reported, and ANAGRPID may be non-zero
ANACAP_ALL = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 7)

# Log pages
LID_ERROR = 0x01
LID_SMART = 0x02
LID_FW_SLOT = 0x03
LID_CHANGED_NS = 0x04
LID_CMD_EFFECTS = 0x05
LID_DISCOVERY = 0x70

# Property offsets
PROP_CAP = 0x00
PROP_VS = 0x08
PROP_CC = 0x14
PROP_CSTS = 0x1C

CC_EN = 0x1
CC_SHN_MASK = 0x3 << 14
CC_SHN_NORMAL = 0x1 << 14
CSTS_RDY = 0x1
CSTS_CFS = 0x2
CSTS_SHST_MASK = 0x3 << 2
CSTS_SHST_COMPLETE = 0x2 << 2
CC_DEFAULT_ENABLE = 0x00460001  # IOCQES=4, IOSQES=6, EN=1

CATTR_DISABLE_SQ_FLOW = 0x04

# Status codes: generic (SCT 0)
SC_SUCCESS = 0x00
SC_INVALID_OPCODE = 0x01
SC_INVALID_FIELD = 0x02
SC_DATA_TRANSFER_ERROR = 0x04
SC_INTERNAL = 0x06
SC_INVALID_NS = 0x0B
SC_CMD_SEQ_ERROR = 0x0C
SC_SGL_DATA_LEN_INVALID = 0x0F
SC_SGL_DESC_TYPE_INVALID = 0x11
SC_SGL_OFFSET_INVALID = 0x16
SC_TRANSIENT_TRANSPORT = 0x22
SC_LBA_OUT_OF_RANGE = 0x80
# command specific (SCT 1)
SCT_GENERIC = 0
SCT_COMMAND_SPECIFIC = 1
SCT_PATH = 3  # path related status: retry on another path (never DNR)
SC_ANA_PERSISTENT_LOSS = 0x01
SC_ANA_INACCESSIBLE = 0x02
SC_ANA_TRANSITION = 0x03
SC_AER_LIMIT_EXCEEDED = 0x05
SC_INVALID_LOG_PAGE = 0x09
SC_FEATURE_NOT_CHANGEABLE = 0x0E
SC_CONNECT_INCOMPATIBLE_FORMAT = 0x80
SC_CONNECT_CTRL_BUSY = 0x81
SC_CONNECT_INVALID_PARAM = 0x82
SC_CONNECT_INVALID_HOST = 0x84

STATUS_NAMES: dict[tuple[int, int], str] = {
    (0, SC_INVALID_OPCODE): "Invalid Opcode",
    (0, SC_INVALID_FIELD): "Invalid Field in Command",
    (0, SC_DATA_TRANSFER_ERROR): "Data Transfer Error",
    (0, SC_INTERNAL): "Internal Error",
    (0, SC_INVALID_NS): "Invalid Namespace or Format",
    (0, SC_CMD_SEQ_ERROR): "Command Sequence Error",
    (0, SC_SGL_DATA_LEN_INVALID): "Data SGL Length Invalid",
    (0, SC_SGL_DESC_TYPE_INVALID): "SGL Descriptor Type Invalid",
    (0, SC_SGL_OFFSET_INVALID): "SGL Offset Invalid",
    (0, SC_TRANSIENT_TRANSPORT): "Transient Transport Error",
    (0, SC_LBA_OUT_OF_RANGE): "LBA Out of Range",
    (1, SC_AER_LIMIT_EXCEEDED): "Asynchronous Event Request Limit Exceeded",
    (3, SC_ANA_PERSISTENT_LOSS): "Asymmetric Access Persistent Loss",
    (3, SC_ANA_INACCESSIBLE): "Asymmetric Access Inaccessible",
    (3, SC_ANA_TRANSITION): "Asymmetric Access Transition",
    (1, SC_INVALID_LOG_PAGE): "Invalid Log Page",
    (1, SC_CONNECT_INCOMPATIBLE_FORMAT): "Connect Incompatible Format",
    (1, SC_CONNECT_CTRL_BUSY): "Connect Controller Busy",
    (1, SC_CONNECT_INVALID_PARAM): "Connect Invalid Parameters",
    (1, SC_CONNECT_INVALID_HOST): "Connect Invalid Host",
}


def status(sc: int, sct: int = SCT_GENERIC, *, dnr: bool = True) -> int:
    """A CQE status field; errors carry DNR by default (retrying would not help)."""
    return make_status(sc, sct, dnr=dnr and not (sc == 0 and sct == 0))


def status_name(sct: int, sc: int) -> str:
    return STATUS_NAMES.get((sct, sc), f"SCT {sct:#x} SC {sc:#04x}")


def vs_value(major: int, minor: int, tertiary: int = 0) -> int:
    return (major << 16) | (minor << 8) | tertiary


def make_cap(*, mqes: int, timeout_500ms: int = 15) -> int:
    """CAP: MQES (0's based), CQR=1, TO, CSS bit 37 (NVM command set), MPSMIN=MPSMAX=0."""
    return (mqes & 0xFFFF) | (1 << 16) | ((timeout_500ms & 0xFF) << 24) | (1 << 37)


def cap_mqes(cap: int) -> int:
    return cap & 0xFFFF


def cap_timeout_s(cap: int) -> float:
    return ((cap >> 24) & 0xFF) * 0.5


def _ascii(text: str, size: int) -> bytes:
    raw = text.encode("ascii", "replace")[:size]
    return raw + b" " * (size - len(raw))


def _nqn(text: str) -> bytes:
    raw = text.encode("utf-8")[: NQN_FIELD - 1]
    return raw + bytes(NQN_FIELD - len(raw))


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


# --- Connect data -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectData:
    """The 1024-byte Fabrics Connect data: HOSTID, CNTLID, SUBNQN, HOSTNQN."""

    hostid: bytes
    cntlid: int
    subnqn: str
    hostnqn: str

    def encode(self) -> bytes:
        out = bytearray(CONNECT_DATA_LEN)
        out[0:16] = self.hostid[:16].ljust(16, b"\0")
        struct.pack_into("<H", out, 16, self.cntlid)
        out[256:512] = _nqn(self.subnqn)
        out[512:768] = _nqn(self.hostnqn)
        return bytes(out)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ConnectData:
        raw = bytes(raw)
        return cls(raw[0:16], struct.unpack_from("<H", raw, 16)[0],
                   _cstr(raw[256:512]), _cstr(raw[512:768]))


# --- Identify Controller ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ControllerInfo:
    """Fields of Identify Controller (CNS 0x01) that kvtool uses; ``raw`` keeps all 4096 bytes."""

    vid: int
    ssvid: int
    sn: str
    mn: str
    fr: str
    mdts: int
    cntlid: int
    ver: int
    cntrltype: int
    kas: int
    sqes: int
    cqes: int
    maxcmd: int
    nn: int
    oncs: int
    vwc: int
    sgls: int
    subnqn: str
    ioccsz: int
    iorcsz: int
    icdoff: int
    msdbd: int
    ctratt: int = 0
    oaes: int = 0
    lpa: int = 0
    elpe: int = 0
    cmic: int = CMIC_MULTI_CTRL  # may have several controllers (one per host)
    anatt: int = 0  # ANA transition time, seconds
    anacap: int = 0
    anagrpmax: int = 0
    nanagrpid: int = 0
    mnan: int = 0  # maximum number of allocated namespaces (Linux multipath needs 1..NN)
    raw: bytes = field(default=b"", repr=False)

    @property
    def ana(self) -> bool:
        """The controller reports Asymmetric Namespace Access (CMIC bit 3)."""
        return bool(self.cmic & CMIC_ANA)

    @property
    def max_transfer(self) -> int | None:
        """Largest data transfer in bytes (MDTS with 4 KiB pages); ``None`` = no limit."""
        return None if self.mdts == 0 else (1 << self.mdts) * 4096

    @property
    def io_in_capsule_max(self) -> int:
        """Largest in-capsule data on an I/O queue: IOCCSZ × 16 − 64."""
        return max(0, self.ioccsz * 16 - 64)

    def encode(self) -> bytes:
        out = bytearray(IDENTIFY_DATA_LEN)
        struct.pack_into("<HH", out, 0, self.vid, self.ssvid)
        out[4:24] = _ascii(self.sn, 20)
        out[24:64] = _ascii(self.mn, 40)
        out[64:72] = _ascii(self.fr, 8)
        out[76] = self.cmic
        out[77] = self.mdts
        struct.pack_into("<HI", out, 78, self.cntlid, self.ver)
        struct.pack_into("<I", out, 92, self.oaes)
        struct.pack_into("<I", out, 96, self.ctratt)
        out[111] = self.cntrltype
        out[259] = 3  # AERL: 4 outstanding AERs (0's based)
        out[261] = self.lpa
        out[262] = self.elpe
        struct.pack_into("<H", out, 320, self.kas)
        out[342] = self.anatt  # offsets as Linux's struct nvme_id_ctrl
        out[343] = self.anacap
        struct.pack_into("<II", out, 344, self.anagrpmax, self.nanagrpid)
        out[512] = self.sqes
        out[513] = self.cqes
        struct.pack_into("<HI", out, 514, self.maxcmd, self.nn)
        struct.pack_into("<H", out, 520, self.oncs)
        out[525] = self.vwc
        struct.pack_into("<I", out, 536, self.sgls)
        struct.pack_into("<I", out, 540, self.mnan)
        out[768:1024] = _nqn(self.subnqn)
        struct.pack_into("<IIHBB", out, 1792, self.ioccsz, self.iorcsz, self.icdoff, 0,
                         self.msdbd)
        return bytes(out)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ControllerInfo:
        raw = bytes(raw)
        if len(raw) < IDENTIFY_DATA_LEN:
            raise ValueError(f"Identify Controller data is {len(raw)} bytes, expected 4096")
        vid, ssvid = struct.unpack_from("<HH", raw, 0)
        cntlid, ver = struct.unpack_from("<HI", raw, 78)
        maxcmd, nn = struct.unpack_from("<HI", raw, 514)
        ioccsz, iorcsz, icdoff, _ctrattr, msdbd = struct.unpack_from("<IIHBB", raw, 1792)
        return cls(
            vid=vid, ssvid=ssvid,
            sn=raw[4:24].decode("ascii", "replace").strip(),
            mn=raw[24:64].decode("ascii", "replace").strip(),
            fr=raw[64:72].decode("ascii", "replace").strip(),
            mdts=raw[77], cntlid=cntlid, ver=ver, cntrltype=raw[111],
            kas=struct.unpack_from("<H", raw, 320)[0], sqes=raw[512], cqes=raw[513],
            maxcmd=maxcmd, nn=nn, oncs=struct.unpack_from("<H", raw, 520)[0], vwc=raw[525],
            sgls=struct.unpack_from("<I", raw, 536)[0], subnqn=_cstr(raw[768:1024]),
            ioccsz=ioccsz, iorcsz=iorcsz, icdoff=icdoff, msdbd=msdbd,
            ctratt=struct.unpack_from("<I", raw, 96)[0],
            oaes=struct.unpack_from("<I", raw, 92)[0], lpa=raw[261], elpe=raw[262],
            cmic=raw[76], anatt=raw[342], anacap=raw[343],
            anagrpmax=struct.unpack_from("<I", raw, 344)[0],
            nanagrpid=struct.unpack_from("<I", raw, 348)[0],
            mnan=struct.unpack_from("<I", raw, 540)[0], raw=raw,
        )


# --- Identify Namespace -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """Identify Namespace (CNS 0x00): size in blocks and the formatted LBA size."""

    nsid: int
    nsze: int
    ncap: int
    nuse: int
    lba_size: int
    nguid: bytes = bytes(16)
    eui64: bytes = bytes(8)
    dlfeat: int = 0
    anagrpid: int = 0  # its ANA group (0: the controller does not report ANA)

    @property
    def size_bytes(self) -> int:
        return self.nsze * self.lba_size

    @property
    def active(self) -> bool:
        return self.nsze > 0

    def encode(self) -> bytes:
        out = bytearray(IDENTIFY_DATA_LEN)
        struct.pack_into("<QQQ", out, 0, self.nsze, self.ncap, self.nuse)
        out[25] = 0  # NLBAF: one format (0's based)
        out[26] = 0  # FLBAS: format 0, no extended metadata
        out[30] = 1  # NMIC: shared (several hosts' controllers may attach it)
        out[33] = self.dlfeat
        struct.pack_into("<I", out, 92, self.anagrpid)
        out[104:120] = self.nguid[:16].ljust(16, b"\0")
        out[120:128] = self.eui64[:8].ljust(8, b"\0")
        lbads = self.lba_size.bit_length() - 1
        struct.pack_into("<I", out, 128, lbads << 16)
        return bytes(out)

    @classmethod
    def decode(cls, nsid: int, raw: bytes | memoryview) -> NamespaceInfo:
        raw = bytes(raw)
        if len(raw) < IDENTIFY_DATA_LEN:
            raise ValueError(f"Identify Namespace data is {len(raw)} bytes, expected 4096")
        nsze, ncap, nuse = struct.unpack_from("<QQQ", raw, 0)
        fmt = raw[26] & 0x0F
        lbaf = struct.unpack_from("<I", raw, 128 + 4 * fmt)[0]
        lbads = (lbaf >> 16) & 0xFF
        return cls(nsid, nsze, ncap, nuse, 1 << lbads if lbads else 0,
                   raw[104:120], raw[120:128], raw[33], struct.unpack_from("<I", raw, 92)[0])


# --- Asymmetric Namespace Access log page (LID 0x0C) -------------------------------------


@dataclass(frozen=True, slots=True)
class AnaGroup:
    """One ANA Group Descriptor: the group's state as seen through the controller that
    returned it, and its namespaces (empty when read with RGO)."""

    grpid: int
    state: int
    nsids: tuple[int, ...] = ()
    chgcnt: int = 0

    @property
    def state_name(self) -> str:
        return ANA_STATE_NAMES.get(self.state, f"state {self.state:#x}")


def encode_ana_log(chgcnt: int, groups: list[AnaGroup], *, rgo: bool = False) -> bytes:
    """Header (CHGCNT, NGRPS) and one descriptor per group (NSIDs unless ``rgo``)."""
    out = bytearray(struct.pack("<QH6x", chgcnt, len(groups)))
    for g in groups:
        nsids = () if rgo else g.nsids
        out += struct.pack("<IIQB15x", g.grpid, len(nsids), g.chgcnt, g.state & 0xF)
        out += b"".join(struct.pack("<I", n) for n in nsids)
    return bytes(out)


def decode_ana_log(raw: bytes | memoryview) -> tuple[int, list[AnaGroup]]:
    """(CHGCNT, groups) of an ANA log page; raises ValueError when it is cut short."""
    raw = bytes(raw)
    if len(raw) < 16:
        raise ValueError(f"ANA log is {len(raw)} bytes, shorter than its header")
    chgcnt, ngrps = struct.unpack_from("<QH", raw, 0)
    groups, off = [], 16
    for _ in range(ngrps):
        if off + 32 > len(raw):
            raise ValueError("ANA log cut short in a group descriptor")
        grpid, nnsid, gchg, state = struct.unpack_from("<IIQB", raw, off)
        off += 32
        if off + 4 * nnsid > len(raw):
            raise ValueError("ANA log cut short in a namespace list")
        nsids = struct.unpack_from(f"<{nnsid}I", raw, off)
        off += 4 * nnsid
        groups.append(AnaGroup(grpid, state & 0xF, tuple(nsids), gchg))
    return chgcnt, groups


def encode_ns_list(nsids: list[int]) -> bytes:
    out = bytearray(IDENTIFY_DATA_LEN)
    for i, nsid in enumerate(sorted(nsids)[:1024]):
        struct.pack_into("<I", out, 4 * i, nsid)
    return bytes(out)


def decode_ns_list(raw: bytes | memoryview) -> list[int]:
    ids = struct.unpack_from("<1024I", bytes(raw)[:IDENTIFY_DATA_LEN].ljust(4096, b"\0"))
    out: list[int] = []
    for nsid in ids:
        if nsid == 0:
            break
        out.append(nsid)
    return out


def encode_ns_descriptors(nguid: bytes, uuid: bytes) -> bytes:
    """Namespace Identification Descriptor list (CNS 0x03): NGUID (type 2), UUID (type 3),
    Command Set Identifier (type 4: 0, NVM), as Linux nvmet lists them."""
    out = bytearray(IDENTIFY_DATA_LEN)
    out[0:4] = bytes([2, 16, 0, 0])
    out[4:20] = nguid[:16].ljust(16, b"\0")
    out[20:24] = bytes([3, 16, 0, 0])
    out[24:40] = uuid[:16].ljust(16, b"\0")
    out[40:44] = bytes([4, 1, 0, 0])
    out[44] = 0
    return bytes(out)


# --- SMART / Health log -------------------------------------------------------------------------

SMART_LOG_LEN = 512


@dataclass(frozen=True, slots=True)
class SmartLog:
    """SMART / Health Information (log page 0x02). Data units are thousands of 512-byte
    units, rounded up: 1 means 1..1000 × 512 B moved."""

    critical_warning: int
    data_units_read: int
    data_units_written: int
    host_reads: int
    host_writes: int
    error_log_entries: int

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> SmartLog:
        raw = bytes(raw)
        if len(raw) < SMART_LOG_LEN:
            raise ValueError(f"SMART log is {len(raw)} bytes, expected 512")

        def u128(off: int) -> int:
            return int.from_bytes(raw[off: off + 16], "little")

        return cls(raw[0], u128(32), u128(48), u128(64), u128(80), u128(176))


# --- Discovery log ------------------------------------------------------------------------------

TRTYPE_TCP = 3
ADRFAM_IPV4 = 1
ADRFAM_IPV6 = 2
SUBTYPE_DISCOVERY = 1
SUBTYPE_NVME = 2
SUBTYPE_CURRENT_DISCOVERY = 3
TREQ_NOT_REQUIRED = 0x2


@dataclass(frozen=True, slots=True)
class DiscoveryEntry:
    """One 1024-byte discovery log page entry (Get Log Page 0x70)."""

    trtype: int
    adrfam: int
    subtype: int
    treq: int
    portid: int
    cntlid: int
    asqsz: int
    trsvcid: str
    subnqn: str
    traddr: str
    sectype: int = 0

    def encode(self) -> bytes:
        out = bytearray(DISCOVERY_LOG_ENTRY)
        struct.pack_into("<BBBBHHHH", out, 0, self.trtype, self.adrfam, self.subtype, self.treq,
                         self.portid, self.cntlid, self.asqsz, 0)
        out[32:64] = _ascii(self.trsvcid, 32)
        out[256:512] = _nqn(self.subnqn)
        out[512:768] = _ascii(self.traddr, 256)
        out[768] = self.sectype
        return bytes(out)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> DiscoveryEntry:
        raw = bytes(raw)
        trtype, adrfam, subtype, treq, portid, cntlid, asqsz, _ef = struct.unpack_from(
            "<BBBBHHHH", raw, 0)
        return cls(trtype, adrfam, subtype, treq, portid, cntlid, asqsz,
                   raw[32:64].decode("ascii", "replace").strip(" \0"),
                   _cstr(raw[256:512]),
                   raw[512:768].decode("ascii", "replace").strip(" \0"),
                   raw[768])


def encode_discovery_log(genctr: int, entries: list[DiscoveryEntry]) -> bytes:
    header = bytearray(DISCOVERY_LOG_HEADER)
    struct.pack_into("<QQH", header, 0, genctr, len(entries), 0)
    return bytes(header) + b"".join(e.encode() for e in entries)


def decode_discovery_header(raw: bytes | memoryview) -> tuple[int, int]:
    """(GENCTR, NUMREC) of a discovery log page."""
    genctr, numrec = struct.unpack_from("<QQ", bytes(raw[:16]), 0)
    return genctr, numrec
