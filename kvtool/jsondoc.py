"""JSON documents as kvtool writes them, on stdout (``--json``) or in files.

Invariant: the text is strict JSON that any reader parses: ``inf`` and ``nan`` become
``null``, numpy scalars plain numbers, tuples lists and dict keys strings. The library
writes its files with :func:`dump_json`; the CLI prints every ``--json`` document with it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, cast


def jsonable(obj: Any) -> Any:
    """``obj`` with every value JSON can hold as it is, and the rest converted as above."""
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars (a float one may be inf)
        return jsonable(obj.item())
    return obj


def dump_json(obj: Any) -> str:
    """JSON text as kvtool prints it: inf/nan become null, numpy scalars plain numbers;
    indented by two spaces, keys in their order, non-ASCII characters escaped.

    When msgspec is loaded already (every replay), the standard encoder writes the
    document compact, in C, and ``msgspec.json.format`` indents it, in C: the same text
    (tests/test_jsondoc.py), in a third of the time of ``json.dumps(indent=2)``, which
    runs in Python. Commands that do not load msgspec keep ``json.dumps``: importing
    msgspec costs more than the indenting saves.
    """
    doc = jsonable(obj)
    fast = sys.modules.get("msgspec")
    if fast is not None:
        return cast(str, fast.json.format(json.dumps(doc).encode(), indent=2).decode())
    return json.dumps(doc, indent=2)


def save_record(path: Path, doc: Any) -> Path:
    """Write ``doc`` to ``path`` as a record kvtool keeps (targets, clusters): readable by
    its owner only (0600), atomically (a reader sees the old file or the new one, never
    part of either) and durably (the file and its directory entry are synced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(doc, indent=2, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path
