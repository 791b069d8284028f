"""Write traces: kvtool JSONL (and Mooncake JSONL, its subset), one record per line."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import msgspec

from kvtool.errors import InputError
from kvtool.trace.schema import Request

_encode = msgspec.json.Encoder().encode


@contextmanager
def _output(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A binary output stream; ``"-"`` is stdout. A file is written whole or not at all."""
    if str(path) == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    target = Path(path)
    if target.is_dir():
        raise InputError("cannot write: Is a directory", file=target)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        f = open(tmp, "wb")  # noqa: SIM115 - closed below, renamed into place on success
    except OSError as err:
        raise InputError(f"cannot write: {err.strerror}", file=target) from None
    try:
        with f:
            yield f
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_records(records: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> int:
    """Write ``records`` as JSONL to ``path`` (``"-"``: stdout); return how many."""
    n = 0
    with _output(path) as out:
        write = out.write
        for rec in records:
            write(_encode(rec))
            write(b"\n")
            n += 1
    return n


def compact_ids(requests: Iterable[Request]) -> Iterator[tuple[Request, list[int]]]:
    """Pair each request with its block keys renumbered 0, 1, 2, … by first appearance.

    Renumbering keeps every equality between keys, so a trace replays identically with
    the compact ids (and its lines get much shorter than with 64-bit keys).
    """
    table: dict[int, int] = {}
    for req in requests:
        ids = []
        for key in req.block_keys:
            i = table.get(key)
            if i is None:
                i = table[key] = len(table)
            ids.append(i)
        yield req, ids


def to_record(req: Request, hash_ids: list[int], *, fmt: str, timestamp: float | None
              ) -> dict[str, Any]:
    """A trace line for ``req`` in ``fmt`` ("kvtool" or "mooncake")."""
    rec: dict[str, Any] = {}
    if timestamp is not None:
        rec["timestamp"] = int(timestamp) if float(timestamp).is_integer() else timestamp
    if fmt == "kvtool":
        if req.session is not None:
            rec["session"] = req.session
        if req.round is not None:
            rec["round"] = req.round
    rec["input_length"] = req.input_length
    rec["output_length"] = req.output_length
    if fmt == "kvtool":
        rec["block_tokens"] = req.block_tokens
    rec["hash_ids"] = hash_ids
    return rec
