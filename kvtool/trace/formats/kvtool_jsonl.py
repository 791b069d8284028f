"""kvtool JSONL (docs/trace.md): a superset of Mooncake's, with optional ``session``,
``round``, ``block_tokens``, or ``tokens`` (token ids hashed into chained block keys)."""

from __future__ import annotations

import msgspec

from kvtool.trace.formats.lines import (
    BadLine,
    LineParser,
    NonNegInt,
    Parsed,
    PosInt,
    TokenId,
    decode,
)
from kvtool.trace.hashing import chain_hashes


class Line(msgspec.Struct, gc=False):
    """A whole kvtool line; presence rules are checked by hand for clear errors."""

    timestamp: float | None = None
    input_length: NonNegInt | None = None
    output_length: NonNegInt | None = None
    hash_ids: list[int] | None = None
    tokens: list[TokenId] | None = None
    session: str | int | None = None
    round: PosInt | None = None
    block_tokens: PosInt | None = None


_DECODER = msgspec.json.Decoder(Line)


class Parser(LineParser):
    """kvtool lines."""

    def parse(self, raw: bytes, *, keys: bool) -> Parsed:
        try:  # the decoder directly: a call less per line
            rec: Line = _DECODER.decode(raw)
        except msgspec.MsgspecError:
            rec = decode(_DECODER, raw)  # raises the line's error in our words
        bt = self.block_tokens
        if rec.hash_ids is not None and rec.tokens is not None:
            raise BadLine("give either hash_ids or tokens, not both", "tokens")
        if rec.block_tokens is not None and rec.block_tokens != bt and (
                rec.tokens is None or self.explicit_block_tokens is None):
            raise BadLine(f"{rec.block_tokens} tokens per block, but the trace uses "
                           f"{self.block_tokens_source} (one block size per trace)",
                           "block_tokens")
        block_keys: list[int]
        if rec.tokens is not None:
            n = len(rec.tokens)
            if rec.input_length is not None and rec.input_length != n:
                raise BadLine(f"{rec.input_length}, but the line has {n} tokens",
                               "input_length")
            block_keys = chain_hashes(rec.tokens, bt) if keys else []
            input_length = n
        elif rec.hash_ids is not None:
            if rec.input_length is None:
                raise BadLine("missing", "input_length")
            input_length = rec.input_length
            self.check_hash_ids(rec.hash_ids, input_length)
            block_keys = rec.hash_ids
        else:
            raise BadLine("missing: a line needs hash_ids or tokens", "hash_ids")
        if rec.output_length is None:
            raise BadLine("missing", "output_length")
        return Parsed(rec.timestamp, input_length, rec.output_length, block_keys, bt,
                       rec.session, rec.round)

