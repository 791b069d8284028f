"""Write traces: kvtool, Mooncake and Qwen-Bailian JSONL, and Azure CSV; one request a line."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import msgspec

from kvtool.errors import InputError
from kvtool.trace.schema import Request

_encode = msgspec.json.Encoder().encode


Output = str | os.PathLike[str] | IO[bytes]
"""Where a writer writes: a file's path, or an open binary stream (the CLI passes its
stdout for ``-``: the library never writes to the process's streams itself)."""


@contextmanager
def _output(path: Output) -> Iterator[IO[bytes]]:
    """A binary output stream: ``path`` itself when it is one, else the file at ``path``,
    written whole or not at all."""
    if not isinstance(path, str | os.PathLike):
        yield path
        path.flush()
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


def write_records(records: Iterable[dict[str, Any]], path: Output) -> int:
    """Write ``records`` as JSONL to ``path`` (a file, or a binary stream); return how many."""
    n = 0
    with _output(path) as out:
        write = out.write
        for rec in records:
            write(_encode(rec))
            write(b"\n")
            n += 1
    return n


AZURE_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
"""Azure CSV output: a trace's time 0 is written as this instant (only differences count)."""


def azure_time(ms: float) -> str:
    """``ms`` after :data:`AZURE_EPOCH` in the Azure CSVs' form, ``1970-01-01 00:00:01.5000000``."""
    ticks = round(ms * 10_000)  # 100 ns, the CSVs' resolution
    seconds, rest = divmod(ticks, 10_000_000)
    when = AZURE_EPOCH + dt.timedelta(seconds=seconds)
    return f"{when:%Y-%m-%d %H:%M:%S}.{rest:07d}"


def write_azure(rows: Iterable[tuple[float, int, int]], path: Output) -> int:
    """Write ``(timestamp_ms, input_length, output_length)`` rows as an Azure CSV."""
    n = 0
    with _output(path) as out:
        write = out.write
        write(b"TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for ts, n_in, n_out in rows:
            write(f"{azure_time(ts)},{n_in},{n_out}\n".encode())
            n += 1
    return n


class BailianChains:
    """Qwen-Bailian ids for requests in serve order: a session becomes a chat chain.

    Request *i* (0-based, serve order) gets ``chat_id`` *i*; its ``parent_chat_id`` is the
    ``chat_id`` of its session's previous request, or -1 for a session's first request
    and for requests without a session; ``turn`` is the round (1 when unknown).
    """

    def __init__(self) -> None:
        self.next_id = 0
        self.last: dict[str | int, int] = {}

    def record(self, req: Request, hash_ids: list[int], timestamp_ms: float) -> dict[str, Any]:
        chat_id = self.next_id
        self.next_id += 1
        parent = -1
        if req.session is not None:
            parent = self.last.get(req.session, -1)
            self.last[req.session] = chat_id
        return {"chat_id": chat_id, "parent_chat_id": parent,
                "timestamp": round(timestamp_ms / 1000.0, 9),
                "input_length": req.input_length, "output_length": req.output_length,
                "type": "text", "turn": req.round or 1, "hash_ids": hash_ids}


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
