"""JSON documents as kvtool writes them, on stdout (``--json``) or in files.

Invariant: the text is strict JSON that any reader parses: ``inf`` and ``nan`` become
``null``, numpy scalars plain numbers, tuples lists and dict keys strings. The library
writes its files with :func:`dump_json`; the CLI prints every ``--json`` document with it.
"""

from __future__ import annotations

import json
import math
from typing import Any


def jsonable(obj: Any) -> Any:
    """``obj`` with every value JSON can hold as it is, and the rest converted as above."""
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return obj


def dump_json(obj: Any) -> str:
    """JSON text as kvtool prints it: inf/nan become null, numpy scalars plain numbers."""
    return json.dumps(jsonable(obj), indent=2, sort_keys=False)
