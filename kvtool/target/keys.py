"""DH-HMAC-CHAP key files for targets: ``kvtool target keygen`` and the per-host key entries.

A target config names key files (``dhchap_key_file``, ``dhchap_ctrl_key_file``), never the
secrets: the config, its re-serialised copy in the state file, plans and status output can
then be shown and stored freely. The secret is read only where a backend must hand it over
(nvmet's configfs ``dhchap_key`` attribute; SPDK and the emulator read the file themselves).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtool.errors import UsageError, param
from kvtool.nvme import dhchap

SCHEMA = "kvtool.target.keygen/1"
TRANSFORMS = {"none": 0, "sha256": 1, "sha384": 2, "sha512": 3}


def keygen(path: str | os.PathLike[str], *, transform: str = "none", length: int | None = None,
           nqn: str | None = None) -> dict[str, Any]:
    """Write a new ``DHHC-1`` secret to ``path`` (created, mode 0600); return what was written.

    ``transform`` sha256/384/512 stores the key already transformed over ``nqn``, as
    ``nvme gen-dhchap-key -m 1..3 -n NQN`` does (the host NQN for a host key, the subsystem
    NQN for a controller key); its length is then the hash's. The document never holds the key.
    """
    hmac_id = TRANSFORMS.get(transform)
    if hmac_id is None:
        raise UsageError(f"unknown transformation {transform!r} (none, sha256, sha384, sha512)",
                         field="transform")
    if hmac_id and not nqn:
        raise UsageError(f"a transformed key is bound to an NQN: give {param('nqn')}",
                         field="nqn")
    if not hmac_id and nqn:
        raise UsageError(f"{param('nqn')} only applies with {param('transform')} "
                         "sha256|sha384|sha512",
                         field="nqn")
    try:
        secret = dhchap.generate_secret(length, hmac_id, nqn)
    except ValueError as exc:
        raise UsageError(str(exc), field="length") from None
    p = Path(path)
    try:
        dhchap.write_secret_file(p, secret)
    except FileExistsError:
        raise UsageError(f"{p} exists; a key file is never overwritten (remove it first)",
                         field="FILE") from None
    except OSError as exc:
        raise UsageError(f"cannot create {p}: {exc.strerror or exc}", field="FILE") from None
    return {"schema": SCHEMA, "path": str(p.resolve()), "transform": transform,
            "key_bytes": len(secret.key), "mode": "0600",
            "format": f"DHHC-1:{secret.hmac:02x}"}
