"""Searching a run's outputs, logs and state files for DH-HMAC-CHAP secrets.

Every form a secret could leak in is a needle: the ``DHHC-1`` text's base64, the key bytes
(raw, hex, base64) and the transformed key the responses are keyed with. The search checks
itself first: each key file must be found by its own needle.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from kvtool.nvme import dhchap


def needles(key_files: dict[str, Path], hostnqn: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, path in key_files.items():
        text = path.read_text().strip()
        s = dhchap.Secret.parse(text)
        out[f"{name}:b64"] = text.split(":")[2][:24].encode()
        out[f"{name}:raw"] = s.key[:16]
        out[f"{name}:hex"] = s.key.hex()[:32].encode()
        out[f"{name}:keyb64"] = base64.b64encode(s.key)[:24]
        out[f"{name}:transformed"] = s.transform(hostnqn)[:16]
        out[f"{name}:transformed-hex"] = s.transform(hostnqn).hex()[:32].encode()
    return out


def hits(blobs: dict[str, bytes], found: dict[str, bytes]) -> list[str]:
    return [f"{n} in {where}" for where, blob in blobs.items() for n, needle in found.items()
            if needle in blob]


def search(blobs: dict[str, bytes], key_files: dict[str, Path], hostnqn: str) -> list[str]:
    """Where any secret of ``key_files`` appears in ``blobs`` (name → bytes); [] is clean."""
    n = needles(key_files, hostnqn)
    for name, path in key_files.items():  # the search itself works
        assert f"{name}:b64 in f" in hits({"f": path.read_bytes()}, n)
    return hits(blobs, n)


def files_under(root: Path, limit: int = 64 << 20) -> dict[str, bytes]:
    """Every file below ``root`` (namespace images, bigger than ``limit``, are not outputs)."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for f in names:
            p = Path(dirpath) / f
            if p.is_file() and p.stat().st_size < limit:
                out[str(p)] = p.read_bytes()
    return out
