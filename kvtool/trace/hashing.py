"""Chained block keys: the one place where kvtool hashes token blocks.

Block *k*'s key covers block *k−1*'s key and block *k*'s token ids (vLLM v1 style), so
two requests share block *k*'s key exactly when they share every token up to the end of
block *k*. Only **full** blocks are hashed: a trailing partial block has no key and is
never cached (docs/definitions.md, "Chain hash").

Invariants:

* deterministic across processes, machines and Python versions (BLAKE2b, never
  :func:`hash`), so a ``hash_ids`` trace written by ``kvtool trace convert`` or
  ``kvtool trace gen`` replays exactly like the ``tokens`` trace it came from;
* a key is an unsigned 64-bit integer (BLAKE2b truncated to 8 bytes);
* token ids are encoded as unsigned 32-bit little-endian integers (every tokenizer's
  vocabulary fits), so a token id outside ``[0, 2**32)`` is rejected.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

TOKEN_MAX = 2**32 - 1
"""Largest token id a key can encode."""

_PERSON = b"kvtool-chain-v1"[:16]
# Domain separation: the first block of a chain hashes a different 9-byte prefix than a
# block whose parent key happens to be zero.
_ROOT = b"\x00" + bytes(8)


def chain_hashes(
    tokens: Sequence[int],
    block_tokens: int,
    *,
    parent: int | None = None,
    extra: bytes = b"",
) -> list[int]:
    """Chained 64-bit keys of the full blocks of ``tokens``.

    ``parent`` is the key of the block just before ``tokens[0]`` (``None`` when
    ``tokens`` starts a sequence), so hashing a sequence in pieces gives the same keys as
    hashing it at once. ``extra`` is mixed into every block (vLLM's "extra keys": a model
    or adapter name that must not share cache entries with another).

    >>> a = chain_hashes(range(10), 4)
    >>> len(a), a == chain_hashes(list(range(8)) + [99, 98], 4)
    (2, True)
    >>> chain_hashes(range(4, 8), 4, parent=a[0]) == a[1:]
    True
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    n_full = len(tokens) // block_tokens
    if n_full == 0:
        return []
    return chain_hashes_bytes(token_bytes(tokens[: n_full * block_tokens]), block_tokens,
                              parent=parent, extra=extra)


def chain_hashes_bytes(
    data: bytes, block_tokens: int, *, parent: int | None = None, extra: bytes = b""
) -> list[int]:
    """:func:`chain_hashes` of tokens already encoded by :func:`token_bytes`.

    For callers that hold tokens as arrays (generators); trailing partial block ignored.
    """
    from hashlib import blake2b  # here: importing hashlib loads OpenSSL (start-up time)

    step = 4 * block_tokens
    n_full = len(data) // step
    tail = len(extra).to_bytes(4, "little") + extra
    prev = _ROOT if parent is None else b"\x01" + (parent & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    keys: list[int] = []
    append = keys.append
    for start in range(0, n_full * step, step):
        digest = blake2b(prev + tail + data[start:start + step], digest_size=8,
                         person=_PERSON).digest()
        append(int.from_bytes(digest, "little"))
        prev = b"\x01" + digest
    return keys


def token_bytes(tokens: Iterable[int]) -> bytes:
    """Token ids as unsigned 32-bit little-endian bytes (the hashed encoding)."""
    try:
        arr = array(_U32, tokens)
    except (OverflowError, TypeError):
        raise ValueError(f"token ids must be integers in [0, {TOKEN_MAX}]") from None
    if sys.byteorder == "big":  # pragma: no cover - every supported platform is little-endian
        arr.byteswap()
    return arr.tobytes()


# The array typecode with 4-byte items ("I" on every common ABI, else "L").
_U32 = "I" if array("I").itemsize == 4 else "L"
