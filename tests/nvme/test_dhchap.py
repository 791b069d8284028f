"""DH-HMAC-CHAP core (kvtool.nvme.dhchap): secrets, transforms, messages, FFDHE, both roles.

Known answers: the secret format against a key nvme-cli/the kernel accepted (the 6.12
recipe's log), the message layouts against the Linux structs (include/linux/nvme.h), the
RFC 7919 primes against their construction from e. The live checks against the Linux
kernel and nvme-cli are in tests/emulator/test_auth_kernel.py.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import stat
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import InputError
from kvtool.nvme import dhchap as D
from kvtool.nvme.ffdhe import PRIMES

SUB = "nqn.2024-01.io.kvtool:auth"
HOST = "nqn.2014-08.org.nvmexpress:uuid:6b767461-7574-4800-8000-000000000001"
# From the 6.12 recipe's run log: the kernel accepted it as dhchap_key, nvme-cli as --dhchap-secret.
KERNEL_KEY = "DHHC-1:00:A+nQkm+fDfdOFBlKFJQemMgquoXrVNDk9ohjl2yoMhmrhhiE:"


# --- secrets ------------------------------------------------------------------------------------

def test_known_secret_parses_and_reencodes_byte_for_byte() -> None:
    s = D.Secret.parse(KERNEL_KEY + "\n")
    assert s.hmac == 0 and len(s.key) == 32
    assert s.encode() == KERNEL_KEY
    raw = base64.b64decode(KERNEL_KEY.split(":")[2])
    assert raw[32:] == struct.pack("<I", zlib.crc32(raw[:32]))


@pytest.mark.parametrize("length", [32, 48, 64])
def test_generated_secret_round_trips(length: int) -> None:
    s = D.generate_secret(length)
    assert D.Secret.parse(s.encode()) == s
    assert len(s.key) == length


@pytest.mark.parametrize("text, why", [
    ("DHHC-2:00:" + KERNEL_KEY.split(":")[2] + ":", "not of the form"),
    (KERNEL_KEY[:-1], "not of the form"),
    ("DHHC-1:0x:" + KERNEL_KEY.split(":")[2] + ":", "two hex digits"),
    ("DHHC-1:00:!!!!:", "base64"),
    ("DHHC-1:00:" + base64.b64encode(b"k" * 20).decode() + ":", "key length"),
    ("DHHC-1:04:" + KERNEL_KEY.split(":")[2] + ":", "transformation"),
    ("DHHC-1:02:" + KERNEL_KEY.split(":")[2] + ":", "does not match"),
])
def test_bad_secrets_are_refused_without_echoing_them(text: str, why: str) -> None:
    with pytest.raises(D.SecretFormatError, match=why) as err:
        D.Secret.parse(text)
    assert KERNEL_KEY.split(":")[2][:12] not in str(err.value)


def test_crc_mismatch_is_detected() -> None:
    raw = bytearray(base64.b64decode(KERNEL_KEY.split(":")[2]))
    raw[0] ^= 1
    with pytest.raises(D.SecretFormatError, match="CRC-32"):
        D.Secret.parse(f"DHHC-1:00:{base64.b64encode(bytes(raw)).decode()}:")


def test_secret_repr_shows_no_key_material() -> None:
    s = D.Secret.parse(KERNEL_KEY)
    for text in (repr(s), str(s), f"{s}", repr(D.HostKeys(s))):
        assert KERNEL_KEY.split(":")[2][:8] not in text
        assert s.key.hex()[:16] not in text


def test_transform_is_hmac_over_nqn_and_label() -> None:
    """Linux nvme_auth_transform_key: HMAC-hash(key, NQN ‖ "NVMe-over-Fabrics")."""
    key = bytes(range(48))
    s = D.Secret(key, 2)
    want = hmac.new(key, HOST.encode() + b"NVMe-over-Fabrics", hashlib.sha384).digest()
    assert s.transform(HOST) == want
    assert D.Secret(bytes(32), 0).transform(HOST) == bytes(32)  # 00: used as is


def test_generate_transformed_secret_like_nvme_cli() -> None:
    """``nvme gen-dhchap-key -m 1 -n NQN -s SEED`` stores HMAC-SHA-256(seed, NQN ‖ label)."""
    seed = bytes.fromhex("11" * 32)
    s = D.generate_secret(hmac_id=1, nqn=HOST, raw=seed)
    assert s.hmac == 1
    assert s.key == hmac.new(seed, HOST.encode() + b"NVMe-over-Fabrics", "sha256").digest()
    with pytest.raises(ValueError):
        D.generate_secret(hmac_id=1)  # a transformed key is bound to an NQN


def test_key_file_round_trip_is_0600(tmp_path: Path) -> None:
    path = tmp_path / "host.key"
    old = os.umask(0)
    try:
        D.write_secret_file(path, D.generate_secret())
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert D.load_secret_file(path, field="--dhchap-secret").hmac == 0
    with pytest.raises(FileExistsError):
        D.write_secret_file(path, D.generate_secret())


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_key_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "k"
    path.write_text(KERNEL_KEY)
    path.chmod(mode)
    with pytest.raises(InputError, match=r"chmod 600") as err:
        D.load_secret_file(path, field="--dhchap-secret")
    assert "--dhchap-secret" in str(err.value)
    assert KERNEL_KEY.split(":")[2][:8] not in str(err.value)


def test_key_file_with_garbage_names_file_not_content(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text("hunter2-not-a-key\n")
    path.chmod(0o600)
    with pytest.raises(InputError, match="not a DH-HMAC-CHAP secret") as err:
        D.load_secret_file(path, field="dhchap_key_file")
    assert "hunter2" not in str(err.value)


# --- algorithm names -------------------------------------------------------------------------

def test_names() -> None:
    assert [D.hash_id(n) for n in ("sha256", "hmac(sha384)", "SHA-512")] == [1, 2, 3]
    assert [D.dhgroup_id(n) for n in ("null", "ffdhe2048", "8192")] == [0, 1, 5]
    with pytest.raises(ValueError):
        D.hash_id("md5")
    with pytest.raises(ValueError):
        D.dhgroup_id("ffdhe1024")


# --- FFDHE ---------------------------------------------------------------------------------------

def _e_fixed(bits: int) -> int:
    """floor(e · 2^bits), from the series Σ 1/k!."""
    scale = 1 << (bits + 32)
    total, term, k = 0, scale, 0
    while term:
        total += term
        k += 1
        term //= k
    return total >> 32


@pytest.mark.parametrize("bits", sorted(PRIMES))
def test_rfc7919_primes_follow_their_construction(bits: int) -> None:
    """p = 2^b − 2^(b−64) + (⌊2^(b−130)·e⌋ + X)·2^64 − 1 with a small X (RFC 7919 §A)."""
    p = PRIMES[bits]
    assert p.bit_length() == bits
    middle = (p + 1 - (1 << bits) + (1 << (bits - 64))) >> 64
    x = middle - _e_fixed(bits - 130)
    assert 0 <= x < 1 << 32
    assert p & ((1 << 64) - 1) == (1 << 64) - 1


def test_ffdhe2048_is_a_safe_prime() -> None:
    p = PRIMES[2048]
    q = (p - 1) // 2
    for base in (2, 3, 5, 7, 11):  # Fermat checks: any composite would fail them
        assert pow(base, p - 1, p) == 1
        assert pow(base, q - 1, q) == 1


def test_dh_agrees_and_checks_the_peer_value() -> None:
    a, b = D.DhKey(1), D.DhKey(1)
    assert len(a.public) == 256
    assert a.shared(b.public) == b.shared(a.public)
    p = PRIMES[2048]
    for bad in (0, 1, p - 1, p):
        with pytest.raises(D.AuthFailed):
            a.shared(bad.to_bytes(257, "big")[-256:] if bad < 1 << 2048 else bytes(256))
    with pytest.raises(D.AuthFailed):
        a.shared(b.public[1:])  # wrong length


# --- message layouts (include/linux/nvme.h) ----------------------------------------------------

def test_negotiate_layout() -> None:
    raw = D.Negotiate(0x1234).encode()
    assert len(raw) == 8 + 64
    assert raw[:8] == bytes([0x00, 0x00, 0, 0, 0x34, 0x12, 0, 1])  # type, id, rsvd, t_id, sc_c, napd
    assert raw[8:12] == bytes([1, 0, 3, 6])  # authid DH-HMAC-CHAP, rsvd, halen, dhlen
    assert raw[12:15] == bytes([1, 2, 3]) and raw[42:48] == bytes([0, 1, 2, 3, 4, 5])
    assert D.decode(raw) == D.Negotiate(0x1234)


def test_challenge_reply_success_failure_layouts() -> None:
    ch = D.Challenge(7, 3, 1, 0xA0B0C0D0, b"c" * 64, b"d" * 256)
    raw = ch.encode()
    assert raw[:16] == struct.pack("<BBHHBBBBHI", 1, 1, 0, 7, 64, 0, 3, 1, 256, 0xA0B0C0D0)
    assert D.decode(raw) == ch
    rep = D.Reply(7, b"r" * 32, b"c" * 32, True, 99, b"")
    assert len(rep.encode()) == 16 + 64 and D.decode(rep.encode()) == rep
    s1 = D.Success1(7, 32, b"x" * 32)
    assert s1.encode()[8] == 1 and D.decode(s1.encode()) == s1
    assert D.decode(D.Success1(7, 32, None).encode()) == D.Success1(7, 32, None)
    assert len(D.Success2(7).encode()) == 16
    f1 = D.Failure(7, D.HASH_UNUSABLE, second=False).encode()
    assert f1 == bytes([0x00, 0xF1, 0, 0, 7, 0, 1, D.HASH_UNUSABLE])
    assert D.decode(D.Failure(7, 1, second=True).encode()).second


@pytest.mark.parametrize("raw", [b"", b"\x01\x01\0\0\0\0", bytes([1, 1, 0, 0, 0, 0, 64, 0]) + bytes(8),
                                 bytes([9, 9]) + bytes(14)])
def test_malformed_messages_fail_as_protocol_errors(raw: bytes) -> None:
    with pytest.raises(D.AuthFailed):
        D.decode(raw)


# --- the two state machines ---------------------------------------------------------------------

def _run(host: D.HostAuth, ctrl: D.ControllerAuth) -> None:
    ctrl.on_send(host.negotiate())
    reply = host.reply(ctrl.on_receive())
    ctrl.on_send(reply)
    s2 = host.finish(ctrl.on_receive())
    if s2 is not None:
        ctrl.on_send(s2)


@pytest.mark.parametrize("hash_name", ["sha256", "sha384", "sha512"])
@pytest.mark.parametrize("group", ["null", "ffdhe2048", "ffdhe3072"])
@pytest.mark.parametrize("bidi", [False, True], ids=["uni", "bi"])
def test_host_and_controller_agree(hash_name: str, group: str, bidi: bool) -> None:
    hk = D.generate_secret(hmac_id=D.hash_id(hash_name), nqn=HOST)
    ck = D.generate_secret(64) if bidi else None
    host = D.HostAuth(HOST, SUB, hk, ck, 42)
    ctrl = D.ControllerAuth(HOST, SUB, D.HostKeys(hk, ck, (D.hash_id(hash_name),),
                                                   (D.dhgroup_id(group),)))
    _run(host, ctrl)
    assert ctrl.authenticated and not ctrl.failed
    assert host.hash is not None and host.hash.name == hash_name
    assert host.dhgroup == D.dhgroup_id(group)


@pytest.mark.slow
@pytest.mark.parametrize("group", ["ffdhe4096", "ffdhe6144", "ffdhe8192"])
def test_large_groups(group: str) -> None:
    hk, ck = D.generate_secret(), D.generate_secret()
    host = D.HostAuth(HOST, SUB, hk, ck, 1)
    ctrl = D.ControllerAuth(HOST, SUB, D.HostKeys(hk, ck, (3,), (D.dhgroup_id(group),)))
    _run(host, ctrl)
    assert ctrl.authenticated


def test_wrong_host_key_gets_failure1() -> None:
    host = D.HostAuth(HOST, SUB, D.generate_secret(), None, 5)
    ctrl = D.ControllerAuth(HOST, SUB, D.HostKeys(D.generate_secret()))
    ctrl.on_send(host.negotiate())
    ctrl.on_send(host.reply(ctrl.on_receive()))
    assert not ctrl.authenticated
    with pytest.raises(D.Rejected) as err:
        host.finish(ctrl.on_receive())
    assert err.value.reason == D.FAILED
    assert ctrl.failed and ctrl.failure_sent


def test_wrong_controller_key_is_caught_by_the_host() -> None:
    hk = D.generate_secret()
    host = D.HostAuth(HOST, SUB, hk, D.generate_secret(), 5)
    ctrl = D.ControllerAuth(HOST, SUB, D.HostKeys(hk, D.generate_secret()))
    ctrl.on_send(host.negotiate())
    ctrl.on_send(host.reply(ctrl.on_receive()))
    with pytest.raises(D.AuthFailed, match="wrong controller key"):
        host.finish(ctrl.on_receive())
    assert not ctrl.authenticated  # it waits for Success2, which never comes
    ctrl.on_send(host.failure2(D.FAILED))
    assert ctrl.failed


def test_bidirectional_host_against_controller_without_ctrl_key() -> None:
    hk = D.generate_secret()
    host = D.HostAuth(HOST, SUB, hk, D.generate_secret(), 5)
    ctrl = D.ControllerAuth(HOST, SUB, D.HostKeys(hk))
    ctrl.on_send(host.negotiate())
    ctrl.on_send(host.reply(ctrl.on_receive()))
    with pytest.raises(D.Rejected):
        host.finish(ctrl.on_receive())


def test_no_common_hash_or_group() -> None:
    hk = D.generate_secret()
    for keys, reason in ((D.HostKeys(hk, hashes=(3,)), D.HASH_UNUSABLE),
                         (D.HostKeys(hk, dhgroups=(5,)), D.DHGROUP_UNUSABLE)):
        host = D.HostAuth(HOST, SUB, hk, None, 1, hashes=(1,), dhgroups=(0, 1))
        ctrl = D.ControllerAuth(HOST, SUB, keys)
        ctrl.on_send(host.negotiate())
        with pytest.raises(D.Rejected) as err:
            host.reply(ctrl.on_receive())
        assert err.value.reason == reason


def test_transaction_id_and_sequence_are_enforced() -> None:
    hk = D.generate_secret()
    host = D.HostAuth(HOST, SUB, hk, None, 1)
    ctrl = D.ControllerAuth(HOST, SUB, D.HostKeys(hk))
    ctrl.on_send(host.negotiate())
    challenge = ctrl.on_receive()
    other = D.HostAuth(HOST, SUB, hk, None, 2)
    with pytest.raises(D.AuthFailed, match="transaction ID"):
        other.reply(challenge)
    ctrl.on_send(D.Success2(1).encode())  # out of sequence
    assert ctrl.on_receive()[1] == D.MSG_FAILURE1
    assert ctrl.reason == D.INCORRECT_MESSAGE


def test_responses_bind_both_nqns() -> None:
    """A response for one host/subsystem pair does not verify for another (replay across NQNs)."""
    hk = D.generate_secret()
    host = D.HostAuth(HOST, SUB, hk, None, 1)
    ctrl = D.ControllerAuth(HOST, SUB + "x", D.HostKeys(hk))
    ctrl.on_send(host.negotiate())
    ctrl.on_send(host.reply(ctrl.on_receive()))
    assert not ctrl.authenticated and ctrl.step == D.MSG_FAILURE1


# --- robustness: whatever a peer sends, only protocol failures come out ------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_controller_survives_any_messages(messages: list[bytes]) -> None:
    hk = D.generate_secret(raw=bytes(32))
    ctrl = D.ControllerAuth(HOST, SUB, D.HostKeys(hk, hk))
    for m in messages:
        ctrl.on_send(m)
        ctrl.on_receive()  # a message, or a Failure1: never an exception
    assert not ctrl.authenticated


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=400), st.binary(max_size=100))
def test_host_survives_any_challenge(challenge: bytes, success1: bytes) -> None:
    host = D.HostAuth(HOST, SUB, D.generate_secret(raw=bytes(32)), D.generate_secret(), 0)
    try:
        host.reply(challenge)
        host.finish(success1)
    except (D.AuthFailed, D.Rejected):
        return
    pytest.fail("a random exchange authenticated a bidirectional host")
