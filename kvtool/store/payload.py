"""Deterministic KV payloads: an object's bytes are a pure function of (source, key).

``verify`` regenerates the expected bytes and compares them, so it proves content, not
only that the stored checksum matches what was stored.

* **synthetic** (default): a seeded pseudo-random base of ``object_bytes`` (numpy PCG64,
  generated once) XOR a 64-bit word derived from the key (splitmix64). Every object is
  distinct, shifted or swapped data never matches, and generating one costs one XOR pass.
* **file**: bytes of a real tensor file (raw, or the data of a ``.npy``) tiled to the
  object size, starting at a key-derived rotation, with the key stamped into the first
  8 bytes; realistic content (compressibility, value distribution) with the same
  guarantees. The file's CRC32C and length are recorded in the superblock.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from kvtool.errors import InputError
from kvtool.store.checksum import crc32c
from kvtool.store.layout import PAYLOAD_FILE, PAYLOAD_SYNTHETIC

_M64 = (1 << 64) - 1

ANALYTIC_CRC_MIN_OBJECTS = 128
"""Below this many objects, checksumming each one is cheaper than the CRC basis."""

# The C library the interpreter is linked against (dlopen(NULL)): ctypes.util.find_library
# would import subprocess and run ldconfig, tens of ms of every command's start-up.
_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def equal(a: np.ndarray, b: np.ndarray) -> bool:
    """``a == b`` for equal-length contiguous uint8 arrays via libc ``memcmp`` (which runs
    without the GIL, through ctypes)."""
    return a.nbytes == b.nbytes and _memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Payload:
    """Generates object bytes for keys; ``fill(key, out)`` writes ``object_bytes`` into ``out``."""

    kind: int = PAYLOAD_SYNTHETIC

    def __init__(self, object_bytes: int, seed: int) -> None:
        self.object_bytes = object_bytes
        self.seed = seed
        words = -(-object_bytes // 8)
        rng = np.random.Generator(np.random.PCG64(seed))
        self._base = rng.integers(0, np.iinfo(np.uint64).max, size=words, dtype=np.uint64,
                                  endpoint=True)
        self._base_bytes = self._base.view(np.uint8)[:object_bytes]
        self._tail = object_bytes % 8
        self._crc_basis: tuple[int, list[int]] | None = None

    @property
    def source_crc(self) -> int:
        return 0

    def expected_crc(self, key: int) -> int | None:
        """CRC32C of ``key``'s payload without generating it (None if not available).

        CRC32C is affine over GF(2): for equal lengths, crc(a ⊕ b) = crc(a) ⊕ crc(b) ⊕
        crc(0ⁿ). The payload is base ⊕ M(w), where M(w) repeats the 64-bit word w, and M is
        linear in w's bits, so crc(payload) = crc(base) ⊕ ⨁_{bit j of w} L_j with
        L_j = crc(M(2^j)) ⊕ crc(0ⁿ), 64 values computed once. ``verify`` uses it once the
        bytes are known to equal the payload, which makes the checksum check free.
        Building the basis costs about 65 CRC passes over one object, so callers use it
        only for at least :data:`ANALYTIC_CRC_MIN_OBJECTS` objects.
        """
        if self._crc_basis is None:
            n, words = self.object_bytes, -(-self.object_bytes // 8)
            pattern = np.zeros(words, dtype=np.uint64)
            zero = crc32c(pattern.view(np.uint8)[:n])
            basis = []
            for j in range(64):
                pattern.fill(np.uint64(1) << np.uint64(j))
                basis.append(crc32c(pattern.view(np.uint8)[:n]) ^ zero)
            self._crc_basis = (crc32c(self._base_bytes), basis)
        crc, basis = self._crc_basis
        w = splitmix64(key ^ self.seed)
        for j in range(64):
            if w >> j & 1:
                crc ^= basis[j]
        return crc

    @property
    def source_bytes(self) -> int:
        return 0

    def fill(self, key: int, out: np.ndarray) -> None:
        """Write the ``object_bytes`` payload of ``key`` into ``out`` (uint8, that long)."""
        mix = np.uint64(splitmix64(key ^ self.seed))
        full = self.object_bytes // 8
        if out.ctypes.data % 8 == 0:
            np.bitwise_xor(self._base[:full], mix, out=out[: full * 8].view(np.uint64))
        else:
            out[: full * 8] = np.bitwise_xor(self._base[:full], mix).view(np.uint8)
        if self._tail:
            last = np.bitwise_xor(self._base[full:], mix).view(np.uint8)
            out[full * 8:] = last[: self._tail]

    def first_difference(self, key: int, data: np.ndarray, scratch: np.ndarray) -> int | None:
        """Byte index of the first mismatch between ``data`` and ``key``'s payload, or None."""
        self.fill(key, scratch)
        if np.array_equal(data, scratch):
            return None
        return int(np.flatnonzero(data != scratch)[0])

    def differences_in_place(self, key: int, data: np.ndarray,
                             scratch: np.ndarray) -> tuple[int, int] | None:
        """Compare ``data`` with ``key``'s payload; ``None`` when equal, else ``(number of
        differing bytes, index of the first)``.

        When ``data`` starts on an 8-byte boundary the key's word is XORed out of it in
        place and the result compared with the base, which touches the bytes once instead
        of generating a second copy (``scratch`` is used otherwise). ``data`` is left
        modified when it matched and restored when it did not.
        """
        n = self.object_bytes
        full = n // 8
        if data.ctypes.data % 8 or data.size != n:
            self.fill(key, scratch)
            if equal(data, scratch):
                return None
            diff = np.flatnonzero(data != scratch)
            return int(diff.size), int(diff[0])
        mix = np.uint64(splitmix64(key ^ self.seed))
        words = data[: full * 8].view(np.uint64)
        np.bitwise_xor(words, mix, out=words)
        tail_ok = True
        if self._tail:
            expect_tail = np.bitwise_xor(self._base[full:], mix).view(np.uint8)[: self._tail]
            tail_ok = bool(np.array_equal(data[full * 8:], expect_tail))
        if tail_ok and equal(data[: full * 8], self._base_bytes[: full * 8]):
            return None
        diff = np.flatnonzero(data[: full * 8] != self._base_bytes[: full * 8])
        np.bitwise_xor(words, mix, out=words)  # restore: a mismatch must stay inspectable
        count, first = int(diff.size), int(diff[0]) if diff.size else n
        if not tail_ok:
            tail_diff = np.flatnonzero(data[full * 8:] != expect_tail) + full * 8
            count += int(tail_diff.size)
            first = min(first, int(tail_diff[0]))
        return count, first


class FilePayload(Payload):
    """Payload tiled from a real tensor file (see the module docstring)."""

    kind = PAYLOAD_FILE

    def __init__(self, object_bytes: int, seed: int, path: str | Path) -> None:
        self.object_bytes = object_bytes
        self.seed = seed
        self.path = Path(path)
        src = _load_bytes(self.path)
        self._crc = crc32c(src)
        self._nbytes = int(src.size)
        reps = -(-(object_bytes + src.size) // src.size)
        self._tiled = np.tile(src, reps)  # long enough for any rotation

    @property
    def source_crc(self) -> int:
        return self._crc

    def expected_crc(self, key: int) -> int | None:
        return None

    @property
    def source_bytes(self) -> int:
        return self._nbytes

    def differences_in_place(self, key: int, data: np.ndarray,
                             scratch: np.ndarray) -> tuple[int, int] | None:
        self.fill(key, scratch)
        if equal(data, scratch):
            return None
        diff = np.flatnonzero(data != scratch)
        return int(diff.size), int(diff[0])

    def fill(self, key: int, out: np.ndarray) -> None:
        start = splitmix64(key ^ self.seed) % self._nbytes
        out[: self.object_bytes] = self._tiled[start:start + self.object_bytes]
        stamp = np.frombuffer(key.to_bytes(8, "little"), dtype=np.uint8)
        k = min(8, self.object_bytes)
        out[:k] = stamp[:k]


def _load_bytes(path: Path) -> np.ndarray:
    try:
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            data = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        else:
            data = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        raise InputError("no such file", file=path, field="payload_file") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read tensor data: {exc}", file=path,
                         field="payload_file") from None
    if data.size == 0:
        raise InputError("payload file is empty", file=path, field="payload_file")
    return np.array(data, copy=True)


def make_payload(object_bytes: int, seed: int, payload_file: str | Path | None = None) -> Payload:
    if payload_file is None:
        return Payload(object_bytes, seed)
    return FilePayload(object_bytes, seed, payload_file)
