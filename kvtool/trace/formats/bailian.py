"""Qwen-Bailian JSONL: ``timestamp`` in seconds (× 1000 here); a request's session is the
root of its ``chat_id`` ← ``parent_chat_id`` chain, its round its ``turn``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from kvtool.errors import InputError
from kvtool.trace.formats.lines import (
    BadLine,
    LineParser,
    NonNegInt,
    Parsed,
    PosInt,
    decode,
)


class BailianLine(msgspec.Struct, gc=False):
    """A Qwen-Bailian line (its README's schema); ``type`` is checked, then ignored."""

    chat_id: int | str | None = None
    parent_chat_id: int | str | None = None
    timestamp: float | None = None
    input_length: NonNegInt | None = None
    output_length: NonNegInt | None = None
    type: str | None = None
    turn: PosInt | None = None
    hash_ids: list[int] | None = None


_DECODER = msgspec.json.Decoder(BailianLine)
BAILIAN_ROOT = -1
"""``parent_chat_id`` of a session's first request in Qwen-Bailian traces."""


class Parser(LineParser):
    """Qwen-Bailian lines; pass 1 checks chat ids are unique and keeps the parents."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chats: dict[str | int, int] = {}  # chat_id -> line
        self.parents: dict[str | int, str | int | None] = {}

    def parse(self, raw: bytes, *, keys: bool) -> Parsed:
        try:  # the decoder directly: a call less per line
            rec: BailianLine = _DECODER.decode(raw)
        except msgspec.MsgspecError:
            rec = decode(_DECODER, raw)  # raises the line's error in our words
        for name in ("chat_id", "timestamp", "input_length", "output_length", "hash_ids"):
            if getattr(rec, name) is None:
                raise BadLine("missing (required in Qwen-Bailian traces)", name)
        assert rec.timestamp is not None and rec.input_length is not None
        assert rec.output_length is not None and rec.hash_ids is not None
        if rec.parent_chat_id == rec.chat_id:
            raise BadLine("a request cannot be its own parent", "parent_chat_id")
        if len(rec.hash_ids) * self.block_tokens >= rec.input_length + self.block_tokens:
            self.check_hash_ids(rec.hash_ids, rec.input_length)
        parent = None if rec.parent_chat_id in (None, BAILIAN_ROOT) else rec.parent_chat_id
        return Parsed(round(rec.timestamp * 1000.0, 6), rec.input_length, rec.output_length,
                       rec.hash_ids, self.block_tokens, rec.chat_id, rec.turn, parent)

    def seen(self, req: Parsed, line: int) -> None:
        chats = self.chats
        assert req.session is not None
        if req.session in chats:
            raise BadLine(f"{json.dumps(req.session)} is also the chat_id of line "
                          f"{chats[req.session]}", "chat_id")
        chats[req.session] = line
        self.parents[req.session] = req.parent

    def finish(self, entries: Sequence[Any]) -> None:
        """Qwen-Bailian: a request's session is the root of its ``parent_chat_id`` chain.

        A root has ``parent_chat_id`` -1; a chain whose parent is not in the trace (cut
        off by the trace's window) is rooted at that parent's id.
        """
        root: dict[str | int, str | int] = {}
        parents = self.parents
        for e in entries:
            assert e.session is not None
            path: list[str | int] = []
            cur: str | int = e.session
            while True:
                if cur in root:
                    top = root[cur]
                    break
                parent = parents.get(cur)
                if parent is None:  # a root, or a parent outside the trace
                    top = cur
                    break
                if cur in path:
                    raise InputError(f"the parent_chat_id chain from chat_id "
                                     f"{json.dumps(e.session)} loops back to "
                                     f"{json.dumps(cur)}", file=self.path, line=e.line,
                                     field="parent_chat_id")
                path.append(cur)
                cur = parent
            for c in path:
                root[c] = top
            e.session = top

