"""Test helpers: hand-built requests and generated traces (real kvtool.trace code)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.trace import Request, read_trace
from kvtool.trace.gen import MultiTurn, multi_turn


def req(keys: list[int], *, session: str | int | None = None, round: int | None = None,
        block_tokens: int = 256, input_length: int | None = None, output_length: int = 0,
        line: int = 0) -> Request:
    """A request whose input is exactly its blocks (unless ``input_length`` is given)."""
    n = len(keys) * block_tokens if input_length is None else input_length
    return Request(0.0, n, output_length, list(keys), block_tokens, session, round, line, None)


def write_multi_turn(path: Path, **params: int) -> Path:
    """Write a ``kvtool trace gen`` multi-turn workload (hash_ids form) to ``path``."""
    spec = MultiTurn(form="hash_ids", **params)  # type: ignore[arg-type]
    with open(path, "w") as f:
        for rec in multi_turn(spec):
            f.write(json.dumps(rec) + "\n")
    return path


def requests_of(path: Path, **kw: object) -> list[Request]:
    return list(read_trace(path, **kw))  # type: ignore[arg-type]
