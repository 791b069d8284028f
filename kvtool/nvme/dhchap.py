"""DH-HMAC-CHAP in-band authentication (NVMe Base spec "Authentication", TP 8006), both roles.

What is here, with no I/O (the host's connect path and the emulator's fabrics dispatch drive it):

* secrets in the ``DHHC-1:hh:base64(key ‖ crc32_le(key)):`` form ``nvme gen-dhchap-key``
  writes, their optional transformation (hh = 01/02/03: HMAC over the NQN and
  "NVMe-over-Fabrics"), key files (mode 0600 only);
* the messages (AUTH_Negotiate, DH-HMAC-CHAP_Challenge/_Reply/_Success1/_Success2,
  _Failure1/_Failure2) as carried by Fabrics Authentication Send/Receive;
* the responses (HMAC over challenge, sequence number, transaction ID, ... in the
  Linux kernel's byte order), the augmented challenge and ephemeral FFDHE (RFC 7919);
* :class:`HostAuth` and :class:`ControllerAuth`, the two state machines.

A :class:`Secret` never shows its bytes in ``repr``/``str`` and no error message here
includes key material, so nothing of a secret reaches logs, JSON or state files.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import InputError
from kvtool.nvme.ffdhe import EXPONENT_BITS, GENERATOR, PRIMES

# --- protocol constants (NVMe Base 2.0 §5.3, §8.13.5; Linux include/linux/nvme.h) -------

SECP_DHCHAP = 0xE9  # Security Protocol of Authentication Send/Receive
SPSP = 0x01  # SPSP0 and SPSP1
FCTYPE_AUTH_SEND = 0x05
FCTYPE_AUTH_RECEIVE = 0x06
CONNECT_ATR = 1 << 17  # Connect response DW0: authentication transaction required
CONNECT_ASCR = 1 << 18  # ... secure channel concatenation required (not supported)
SC_AUTH_REQUIRED = 0x91  # SCT 1 (command specific): a command before authentication
RECEIVE_LEN = 4096  # allocation length of every Authentication Receive (the Linux host's)

TYPE_COMMON, TYPE_DHCHAP = 0x00, 0x01
MSG_NEGOTIATE = 0x00
MSG_CHALLENGE, MSG_REPLY, MSG_SUCCESS1, MSG_SUCCESS2 = 0x01, 0x02, 0x03, 0x04
MSG_FAILURE2, MSG_FAILURE1 = 0xF0, 0xF1
AUTHID_DHCHAP = 0x01
RESCODE_FAILED = 0x01

FAILED = 0x01
NOT_USABLE = 0x02
CONCAT_MISMATCH = 0x03
HASH_UNUSABLE = 0x04
DHGROUP_UNUSABLE = 0x05
INCORRECT_PAYLOAD = 0x06
INCORRECT_MESSAGE = 0x07
REASONS = {
    FAILED: "authentication failed",
    NOT_USABLE: "authentication protocol not usable",
    CONCAT_MISMATCH: "secure channel concatenation mismatch",
    HASH_UNUSABLE: "no common hash function",
    DHGROUP_UNUSABLE: "no common DH group",
    INCORRECT_PAYLOAD: "incorrect payload",
    INCORRECT_MESSAGE: "incorrect protocol message",
}


def reason_name(code: int) -> str:
    return REASONS.get(code, f"reason {code:#04x}")


@dataclass(frozen=True)
class HashAlg:
    id: int
    name: str  # hashlib name
    size: int


HASHES: dict[int, HashAlg] = {1: HashAlg(1, "sha256", 32), 2: HashAlg(2, "sha384", 48),
                              3: HashAlg(3, "sha512", 64)}
DHGROUPS: dict[int, str] = {0: "null", 1: "ffdhe2048", 2: "ffdhe3072", 3: "ffdhe4096",
                            4: "ffdhe6144", 5: "ffdhe8192"}
DHGROUP_BITS = {0: 0, 1: 2048, 2: 3072, 3: 4096, 4: 6144, 5: 8192}
# What a host offers, in the Linux host's order; a controller picks from its own list.
ALL_HASHES: tuple[int, ...] = (1, 2, 3)
ALL_DHGROUPS: tuple[int, ...] = (0, 1, 2, 3, 4, 5)


def hash_id(name: str) -> int:
    """``sha256`` / ``hmac(sha256)`` / ``SHA-256`` → the protocol's hash ID; ValueError otherwise."""
    key = name.strip().lower().removeprefix("hmac(").removesuffix(")").replace("-", "")
    for h in HASHES.values():
        if h.name == key:
            return h.id
    raise ValueError(f"unknown DH-HMAC-CHAP hash {name!r} (sha256, sha384, sha512)")


def dhgroup_id(name: str) -> int:
    """``null`` / ``ffdhe2048`` … ``ffdhe8192`` → the protocol's DH group ID; ValueError otherwise."""
    key = name.strip().lower()
    for gid, gname in DHGROUPS.items():
        if key in (gname, gname.removeprefix("ffdhe")):
            return gid
    raise ValueError(f"unknown DH group {name!r} (null, ffdhe2048, ffdhe3072, ffdhe4096, "
                     "ffdhe6144, ffdhe8192)")


# --- secrets ------------------------------------------------------------------------------

class SecretFormatError(ValueError):
    """A string is not a valid ``DHHC-1`` secret. The message never contains the secret."""


_TRANSFORM_SUFFIX = b"NVMe-over-Fabrics"


class Secret:
    """A DH-HMAC-CHAP secret: key bytes (32, 48 or 64) and its transformation hash (0 = none)."""

    __slots__ = ("_key", "hmac")

    def __init__(self, key: bytes, hmac_id: int = 0) -> None:
        if len(key) not in (32, 48, 64):
            raise SecretFormatError(f"key length {len(key)} bytes (must be 32, 48 or 64)")
        if hmac_id not in (0, 1, 2, 3):
            raise SecretFormatError(f"transformation {hmac_id:02x} (must be 00..03)")
        if hmac_id and len(key) != HASHES[hmac_id].size:
            raise SecretFormatError(f"key length {len(key)} bytes does not match transformation "
                                    f"{hmac_id:02x} ({HASHES[hmac_id].size} bytes)")
        self._key = bytes(key)
        self.hmac = hmac_id

    @classmethod
    def parse(cls, text: str) -> Secret:
        """Parse ``DHHC-1:hh:base64:`` (whitespace around it is ignored); check the CRC."""
        parts = text.strip().split(":")
        if len(parts) != 4 or parts[0] != "DHHC-1" or parts[3] != "":
            raise SecretFormatError("not of the form DHHC-1:hh:<base64>:")
        if len(parts[1]) != 2 or not all(c in "0123456789abcdefABCDEF" for c in parts[1]):
            raise SecretFormatError("the transformation field must be two hex digits (00..03)")
        try:
            raw = base64.b64decode(parts[2], validate=True)
        except (binascii.Error, ValueError):
            raise SecretFormatError("the key field is not valid base64") from None
        key, crc = raw[:-4], raw[-4:]
        if len(key) not in (32, 48, 64):
            raise SecretFormatError(f"key length {len(key)} bytes (must be 32, 48 or 64)")
        if struct.pack("<I", zlib.crc32(key) & 0xFFFFFFFF) != crc:
            raise SecretFormatError("CRC-32 mismatch (the key is damaged or mistyped)")
        return cls(key, int(parts[1], 16))

    @property
    def key(self) -> bytes:
        return self._key

    def encode(self) -> str:
        crc = struct.pack("<I", zlib.crc32(self._key) & 0xFFFFFFFF)
        return f"DHHC-1:{self.hmac:02x}:{base64.b64encode(self._key + crc).decode()}:"

    def transform(self, nqn: str) -> bytes:
        """The HMAC key used for a response (Linux ``nvme_auth_transform_key``)."""
        if not self.hmac:
            return self._key
        return hmac.new(self._key, nqn.encode() + _TRANSFORM_SUFFIX,
                        HASHES[self.hmac].name).digest()

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Secret) and other.hmac == self.hmac
                and hmac.compare_digest(other._key, self._key))

    def __hash__(self) -> int:
        return hash((self.hmac, hashlib.sha256(self._key).digest()))

    def __repr__(self) -> str:
        return f"<Secret DHHC-1:{self.hmac:02x} {len(self._key)} bytes>"

    __str__ = __repr__


def generate_secret(length: int | None = None, hmac_id: int = 0, nqn: str | None = None,
                    raw: bytes | None = None) -> Secret:
    """A new secret, as ``nvme gen-dhchap-key [-m hmac_id] [-l length] [-n nqn]`` makes it.

    With ``hmac_id`` 1..3 the random (or given ``raw``) key is stored already transformed
    over ``nqn`` (libnvme ``nvme_gen_dhchap_key``); its length is then the hash's size.
    """
    if hmac_id:
        size = HASHES[hmac_id].size
        if length not in (None, size):
            raise ValueError(f"transformation {hmac_id:02x} makes {size}-byte keys")
        if not nqn:
            raise ValueError("a transformed secret needs the NQN it is bound to")
        seed = raw if raw is not None else os.urandom(size)
        key = hmac.new(seed, nqn.encode() + _TRANSFORM_SUFFIX, HASHES[hmac_id].name).digest()
        return Secret(key, hmac_id)
    length = length or (len(raw) if raw is not None else 32)
    if length not in (32, 48, 64):
        raise ValueError("key length must be 32, 48 or 64 bytes")
    return Secret(raw if raw is not None else os.urandom(length), 0)


def load_secret_file(path: str | os.PathLike[str], *, field: str) -> Secret:
    """Read a key file (one ``DHHC-1`` secret). Refuses files others may read: InputError."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{p}: not a regular file", field=field)
        if st.st_mode & 0o077:
            raise InputError(f"{p}: key file mode is {stat.S_IMODE(st.st_mode):04o}; it must not "
                             f"be readable or writable by group or others (chmod 600 {p})",
                             field=field)
        text = p.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise InputError(f"{p}: cannot read key file: {exc.strerror or exc}", field=field) from None
    try:
        return Secret.parse(text)
    except SecretFormatError as exc:
        raise InputError(f"{p}: not a DH-HMAC-CHAP secret: {exc}", field=field) from None


def write_secret_file(path: str | os.PathLike[str], secret: Secret) -> None:
    """Create ``path`` with mode 0600 holding ``secret``; an existing file is an error."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (secret.encode() + "\n").encode())
    finally:
        os.close(fd)


# --- the responses ----------------------------------------------------------------------------

def host_response(h: HashAlg, key: bytes, challenge: bytes, seqnum: int, tid: int, sc_c: int,
                  hostnqn: str, subnqn: str) -> bytes:
    """R1 = HMAC(Kh, C1 ‖ S1 ‖ T_ID ‖ SC_C ‖ "HostHost" ‖ NQNh ‖ 00 ‖ NQNc) (little-endian ints)."""
    m = hmac.new(key, digestmod=h.name)
    m.update(challenge)
    m.update(struct.pack("<IHB", seqnum, tid, sc_c))
    m.update(b"HostHost" + hostnqn.encode() + b"\0" + subnqn.encode())
    return m.digest()


def ctrl_response(h: HashAlg, key: bytes, challenge: bytes, seqnum: int, tid: int, sc_c: int,
                  subnqn: str, hostnqn: str) -> bytes:
    """R2 = HMAC(Kc, C2 ‖ S2 ‖ T_ID ‖ SC_C ‖ "Controller" ‖ NQNc ‖ 00 ‖ NQNh)."""
    m = hmac.new(key, digestmod=h.name)
    m.update(challenge)
    m.update(struct.pack("<IHB", seqnum, tid, sc_c))
    m.update(b"Controller" + subnqn.encode() + b"\0" + hostnqn.encode())
    return m.digest()


def augmented_challenge(h: HashAlg, shared: bytes, challenge: bytes) -> bytes:
    """Ca = HMAC(H(g^xy mod p), C): what the responses cover when a DH group is in use."""
    return hmac.new(hashlib.new(h.name, shared).digest(), challenge, h.name).digest()


class DhKey:
    """An ephemeral FFDHE key pair for one transaction (Python's ``pow``; fixed-size encoding)."""

    def __init__(self, group: int) -> None:
        bits = DHGROUP_BITS[group]
        self.p = PRIMES[bits]
        self.size = bits // 8
        self._x = secrets.randbits(EXPONENT_BITS[bits]) | (1 << (EXPONENT_BITS[bits] - 1))
        self.public = pow(GENERATOR, self._x, self.p).to_bytes(self.size, "big")

    def shared(self, peer: bytes) -> bytes:
        """g^xy mod p, big-endian, padded to the modulus size (as the kernel's kpp writes it)."""
        y = int.from_bytes(peer, "big")
        if len(peer) != self.size or not 1 < y < self.p - 1:
            raise AuthFailed(DHGROUP_UNUSABLE, "the peer's DH public value is invalid")
        return pow(y, self._x, self.p).to_bytes(self.size, "big")


# --- messages -------------------------------------------------------------------------------

class AuthFailed(Exception):
    """This side refused the transaction. ``reason`` is the protocol's failure code."""

    def __init__(self, reason: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Negotiate:
    tid: int
    hashes: tuple[int, ...] = ALL_HASHES
    dhgroups: tuple[int, ...] = ALL_DHGROUPS
    sc_c: int = 0
    authid: int = AUTHID_DHCHAP
    napd: int = 1

    def encode(self) -> bytes:
        idlist = bytearray(60)
        idlist[:len(self.hashes)] = bytes(self.hashes)
        idlist[30:30 + len(self.dhgroups)] = bytes(self.dhgroups)
        return (struct.pack("<BBHHBB", TYPE_COMMON, MSG_NEGOTIATE, 0, self.tid, self.sc_c,
                            self.napd)
                + struct.pack("<BBBB", self.authid, 0, len(self.hashes), len(self.dhgroups))
                + bytes(idlist))


@dataclass(frozen=True)
class Challenge:
    tid: int
    hash_id: int
    dhgroup: int
    seqnum: int
    cval: bytes
    dhv: bytes = b""

    def encode(self) -> bytes:
        return (struct.pack("<BBHHBBBBHI", TYPE_DHCHAP, MSG_CHALLENGE, 0, self.tid,
                            len(self.cval), 0, self.hash_id, self.dhgroup, len(self.dhv),
                            self.seqnum) + self.cval + self.dhv)


@dataclass(frozen=True)
class Reply:
    tid: int
    rval: bytes
    cval: bytes  # C2 (zeros when unidirectional)
    cvalid: bool
    seqnum: int  # S2 (0 when unidirectional)
    dhv: bytes = b""

    def encode(self) -> bytes:
        return (struct.pack("<BBHHBBBBHI", TYPE_DHCHAP, MSG_REPLY, 0, self.tid, len(self.rval),
                            0, 1 if self.cvalid else 0, 0, len(self.dhv), self.seqnum)
                + self.rval + self.cval + self.dhv)


@dataclass(frozen=True)
class Success1:
    tid: int
    hl: int
    rval: bytes | None  # the controller's response R2 (bidirectional only)

    def encode(self) -> bytes:
        head = struct.pack("<BBHHBBB7x", TYPE_DHCHAP, MSG_SUCCESS1, 0, self.tid, self.hl, 0,
                           1 if self.rval is not None else 0)
        return head + (self.rval if self.rval is not None else bytes(self.hl))


@dataclass(frozen=True)
class Success2:
    tid: int

    def encode(self) -> bytes:
        return struct.pack("<BBHH10x", TYPE_DHCHAP, MSG_SUCCESS2, 0, self.tid)


@dataclass(frozen=True)
class Failure:
    tid: int
    reason: int
    second: bool  # Failure2 (host → controller) rather than Failure1

    def encode(self) -> bytes:
        return struct.pack("<BBHHBB", TYPE_COMMON, MSG_FAILURE2 if self.second else MSG_FAILURE1,
                           0, self.tid, RESCODE_FAILED, self.reason)


Message = Negotiate | Challenge | Reply | Success1 | Success2 | Failure


def decode(data: bytes | memoryview) -> Message:
    """Parse one message; raises :class:`AuthFailed` (incorrect payload/message) when malformed."""
    b = bytes(data)
    if len(b) < 8:
        raise AuthFailed(INCORRECT_PAYLOAD, f"message of {len(b)} bytes is too short")
    kind, msg, _, tid = struct.unpack_from("<BBHH", b)
    try:
        if kind == TYPE_COMMON and msg == MSG_NEGOTIATE:
            sc_c, napd = struct.unpack_from("<BB", b, 6)
            authid, _, halen, dhlen = struct.unpack_from("<BBBB", b, 8)
            if napd < 1 or len(b) < 8 + 64 or halen > 30 or dhlen > 30:
                raise AuthFailed(INCORRECT_PAYLOAD, "malformed AUTH_Negotiate")
            ids = b[12:72]
            return Negotiate(tid, tuple(ids[:halen]), tuple(ids[30:30 + dhlen]), sc_c, authid,
                             napd)
        if kind == TYPE_COMMON and msg in (MSG_FAILURE1, MSG_FAILURE2):
            _rescode, exp = struct.unpack_from("<BB", b, 6)
            return Failure(tid, exp, msg == MSG_FAILURE2)
        if kind != TYPE_DHCHAP:
            raise AuthFailed(INCORRECT_MESSAGE, f"unknown message type {kind:#x}/{msg:#x}")
        if msg == MSG_CHALLENGE:
            _, _, _, _, hl, _, hid, dhg, dhvlen, seq = struct.unpack_from("<BBHHBBBBHI", b)
            if len(b) < 16 + hl + dhvlen:
                raise AuthFailed(INCORRECT_PAYLOAD, "truncated DH-HMAC-CHAP_Challenge")
            return Challenge(tid, hid, dhg, seq, b[16:16 + hl], b[16 + hl:16 + hl + dhvlen])
        if msg == MSG_REPLY:
            _, _, _, _, hl, _, cvalid, _, dhvlen, seq = struct.unpack_from("<BBHHBBBBHI", b)
            if len(b) < 16 + 2 * hl + dhvlen:
                raise AuthFailed(INCORRECT_PAYLOAD, "truncated DH-HMAC-CHAP_Reply")
            return Reply(tid, b[16:16 + hl], b[16 + hl:16 + 2 * hl], bool(cvalid & 1), seq,
                         b[16 + 2 * hl:16 + 2 * hl + dhvlen])
        if msg == MSG_SUCCESS1:
            hl, _, rvalid = struct.unpack_from("<BBB", b, 6)
            if rvalid & 1 and len(b) < 16 + hl:
                raise AuthFailed(INCORRECT_PAYLOAD, "truncated DH-HMAC-CHAP_Success1")
            return Success1(tid, hl, b[16:16 + hl] if rvalid & 1 else None)
        if msg == MSG_SUCCESS2:
            return Success2(tid)
    except struct.error:
        raise AuthFailed(INCORRECT_PAYLOAD, "truncated authentication message") from None
    raise AuthFailed(INCORRECT_MESSAGE, f"unknown message {kind:#x}/{msg:#x}")


def _seqnum() -> int:
    return secrets.randbelow(0xFFFFFFFF) + 1  # never 0: 0 means "no bidirectional"


# --- the host ---------------------------------------------------------------------------------

class HostAuth:
    """One host-side transaction on one queue (sans I/O).

    ``negotiate()`` → send; receive → ``reply(msg)`` → send; receive → ``finish(msg)`` →
    send what it returns (Success2) if anything. :class:`AuthFailed` from ``reply``/``finish``
    means this host refused the controller: send :meth:`failure2` before giving up.
    :class:`Rejected` means the controller refused this host (it sent Failure1).
    """

    def __init__(self, hostnqn: str, subnqn: str, secret: Secret, ctrl_secret: Secret | None,
                 tid: int, hashes: tuple[int, ...] = ALL_HASHES,
                 dhgroups: tuple[int, ...] = ALL_DHGROUPS) -> None:
        self.hostnqn, self.subnqn = hostnqn, subnqn
        self._secret, self._ctrl_secret = secret, ctrl_secret
        self.tid = tid & 0xFFFF
        self.hashes, self.dhgroups = hashes, dhgroups
        self.hash: HashAlg | None = None
        self.dhgroup: int | None = None
        self._expect: bytes | None = None

    @property
    def bidirectional(self) -> bool:
        return self._ctrl_secret is not None

    def negotiate(self) -> bytes:
        return Negotiate(self.tid, self.hashes, self.dhgroups).encode()

    def failure2(self, reason: int) -> bytes:
        return Failure(self.tid, reason, second=True).encode()

    def _expect_msg(self, data: bytes | memoryview, cls: type) -> Message:
        msg = decode(data)
        if isinstance(msg, Failure) and not msg.second:
            raise Rejected(msg.reason)
        if not isinstance(msg, cls):
            raise AuthFailed(INCORRECT_MESSAGE, f"expected {cls.__name__}, got "
                             f"{type(msg).__name__}")
        if msg.tid != self.tid:
            raise AuthFailed(INCORRECT_PAYLOAD, f"transaction ID {msg.tid} is not {self.tid}")
        return msg

    def reply(self, data: bytes | memoryview) -> bytes:
        ch = self._expect_msg(data, Challenge)
        assert isinstance(ch, Challenge)
        h = HASHES.get(ch.hash_id)
        if h is None or ch.hash_id not in self.hashes:
            raise AuthFailed(HASH_UNUSABLE, f"the controller chose hash ID {ch.hash_id}, "
                             "which was not offered")
        if ch.dhgroup not in self.dhgroups or ch.dhgroup not in DHGROUPS:
            raise AuthFailed(DHGROUP_UNUSABLE, f"the controller chose DH group {ch.dhgroup}, "
                             "which was not offered")
        if len(ch.cval) != h.size:
            raise AuthFailed(INCORRECT_PAYLOAD, f"challenge of {len(ch.cval)} bytes for {h.name}")
        self.hash, self.dhgroup = h, ch.dhgroup
        c1, dhv, shared = ch.cval, b"", b""
        if ch.dhgroup:
            if not ch.dhv:
                raise AuthFailed(DHGROUP_UNUSABLE, "DH group chosen but no DH value sent")
            key = DhKey(ch.dhgroup)
            shared, dhv = key.shared(ch.dhv), key.public
            c1 = augmented_challenge(h, shared, c1)
        elif ch.dhv:
            raise AuthFailed(INCORRECT_PAYLOAD, "a DH value with the NULL group")
        rval = host_response(h, self._secret.transform(self.hostnqn), c1, ch.seqnum, self.tid,
                             0, self.hostnqn, self.subnqn)
        c2, s2 = bytes(h.size), 0
        if self._ctrl_secret is not None:
            c2, s2 = secrets.token_bytes(h.size), _seqnum()
            c2a = augmented_challenge(h, shared, c2) if ch.dhgroup else c2
            self._expect = ctrl_response(h, self._ctrl_secret.transform(self.subnqn), c2a, s2,
                                         self.tid, 0, self.subnqn, self.hostnqn)
        return Reply(self.tid, rval, c2, self._ctrl_secret is not None, s2, dhv).encode()

    def finish(self, data: bytes | memoryview) -> bytes | None:
        """Check Success1 (and the controller's response); return Success2 to send, or None."""
        s1 = self._expect_msg(data, Success1)
        assert isinstance(s1, Success1) and self.hash is not None
        if s1.hl != self.hash.size:
            raise AuthFailed(INCORRECT_PAYLOAD, f"Success1 hash length {s1.hl}")
        if self._expect is None:
            return None
        if s1.rval is None:
            raise AuthFailed(FAILED, "the controller did not answer the host's challenge "
                             "(it has no controller key for this host)")
        if not hmac.compare_digest(s1.rval, self._expect):
            raise AuthFailed(FAILED, "the controller's response does not match "
                             "(wrong controller key)")
        return Success2(self.tid).encode()


class Rejected(Exception):
    """The controller refused this host (DH-HMAC-CHAP_Failure1)."""

    def __init__(self, reason: int) -> None:
        super().__init__(reason_name(reason))
        self.reason = reason


# --- the controller ---------------------------------------------------------------------------

@dataclass(frozen=True)
class HostKeys:
    """What a controller knows about one host: its secret, its own secret, allowed algorithms."""

    secret: Secret
    ctrl_secret: Secret | None = None
    hashes: tuple[int, ...] = ALL_HASHES  # preference order
    dhgroups: tuple[int, ...] = ALL_DHGROUPS


class ControllerAuth:
    """One controller-side transaction on one queue (sans I/O), with the kernel target's steps.

    ``on_send(data)`` for each Authentication Send, ``on_receive()`` for each Authentication
    Receive (returns the message). ``authenticated`` becomes true once the host proved its
    key (and, bidirectional, acknowledged the controller's proof with Success2); ``failed``
    once a Failure1 was handed out or a Failure2 arrived — the queue should then be closed.
    """

    def __init__(self, hostnqn: str, subnqn: str, keys: HostKeys) -> None:
        self.hostnqn, self.subnqn, self.keys = hostnqn, subnqn, keys
        self.step = MSG_NEGOTIATE
        self.authenticated = False
        self.failed = False
        self.failure_sent = False
        self.reason = 0
        self.message = ""
        self.tid = 0
        self.hash: HashAlg | None = None
        self.dhgroup = 0
        self._s1 = 0
        self._c1 = b""
        self._dh: DhKey | None = None
        self._shared = b""
        self._bidi: tuple[bytes, int] | None = None

    def _fail(self, reason: int, message: str) -> None:
        self.step = MSG_FAILURE1
        self.reason, self.message = reason, message
        self.authenticated = False

    def on_send(self, data: bytes | memoryview) -> None:
        try:
            msg = decode(data)
        except AuthFailed as exc:
            self._fail(exc.reason, str(exc))
            return
        if isinstance(msg, Negotiate):
            # a new Negotiate restarts the transaction (re-authentication)
            self.authenticated = self.failed = False
            self._negotiate(msg)
        elif isinstance(msg, Failure) and msg.second:
            self.failed = True
            self.reason, self.message = msg.reason, f"the host refused: {reason_name(msg.reason)}"
            self.step = MSG_FAILURE2
        elif msg.tid != self.tid:
            self._fail(INCORRECT_PAYLOAD, f"transaction ID {msg.tid} is not {self.tid}")
        elif isinstance(msg, Reply) and self.step == MSG_REPLY:
            self._reply(msg)
        elif isinstance(msg, Success2) and self.step == MSG_SUCCESS2:
            self.authenticated = True
            self.step = MSG_NEGOTIATE
        else:
            self._fail(INCORRECT_MESSAGE, f"unexpected {type(msg).__name__}")

    def _negotiate(self, msg: Negotiate) -> None:
        self.tid = msg.tid
        if msg.sc_c != 0:
            self._fail(CONCAT_MISMATCH, "secure channel concatenation is not supported")
            return
        if msg.authid != AUTHID_DHCHAP:
            self._fail(INCORRECT_PAYLOAD, f"authentication protocol {msg.authid} is not "
                       "DH-HMAC-CHAP")
            return
        hid = next((h for h in self.keys.hashes if h in msg.hashes), None)
        if hid is None:
            self._fail(HASH_UNUSABLE, "no hash function the host offers is allowed")
            return
        gid = next((g for g in self.keys.dhgroups if g in msg.dhgroups), None)
        if gid is None:
            self._fail(DHGROUP_UNUSABLE, "no DH group the host offers is allowed")
            return
        self.hash, self.dhgroup = HASHES[hid], gid
        self.step = MSG_CHALLENGE

    def _reply(self, msg: Reply) -> None:
        h = self.hash
        assert h is not None
        if len(msg.rval) != h.size:
            self._fail(INCORRECT_PAYLOAD, f"response of {len(msg.rval)} bytes for {h.name}")
            return
        c1 = self._c1
        if self.dhgroup:
            assert self._dh is not None
            try:
                self._shared = self._dh.shared(msg.dhv)
            except AuthFailed as exc:
                self._fail(exc.reason, str(exc))
                return
            c1 = augmented_challenge(h, self._shared, c1)
        elif msg.dhv:
            self._fail(INCORRECT_PAYLOAD, "a DH value with the NULL group")
            return
        want = host_response(h, self.keys.secret.transform(self.hostnqn), c1, self._s1,
                             self.tid, 0, self.hostnqn, self.subnqn)
        if not hmac.compare_digest(want, msg.rval):
            self._fail(FAILED, "host response mismatch (wrong host key)")
            return
        if msg.cvalid and msg.seqnum:
            self._bidi = (msg.cval, msg.seqnum)
        else:
            self._bidi = None
            self.authenticated = True
        self.step = MSG_SUCCESS1

    def on_receive(self) -> bytes:
        if self.step == MSG_CHALLENGE:
            h = self.hash
            assert h is not None
            self._s1, self._c1 = _seqnum(), secrets.token_bytes(h.size)
            dhv = b""
            if self.dhgroup:
                self._dh = DhKey(self.dhgroup)
                dhv = self._dh.public
            self.step = MSG_REPLY
            return Challenge(self.tid, h.id, self.dhgroup, self._s1, self._c1, dhv).encode()
        if self.step == MSG_SUCCESS1:
            h = self.hash
            assert h is not None
            rval = None
            if self._bidi is not None:
                ctrl = self.keys.ctrl_secret
                if ctrl is None:
                    self._fail(FAILED, "the host asked the controller to authenticate, but no "
                               "controller key is configured for it")
                    return self._failure1()
                c2, s2 = self._bidi
                if self.dhgroup:
                    c2 = augmented_challenge(h, self._shared, c2)
                rval = ctrl_response(h, ctrl.transform(self.subnqn), c2, s2, self.tid, 0,
                                     self.subnqn, self.hostnqn)
                self.step = MSG_SUCCESS2
            else:
                self.step = MSG_NEGOTIATE
            return Success1(self.tid, h.size, rval).encode()
        if self.step != MSG_FAILURE1:
            self._fail(INCORRECT_MESSAGE, "Authentication Receive out of sequence")
        return self._failure1()

    def _failure1(self) -> bytes:
        self.failed = self.failure_sent = True
        return Failure(self.tid, self.reason or FAILED, second=False).encode()
