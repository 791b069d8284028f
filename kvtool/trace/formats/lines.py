"""What every trace format's line parser shares: the line it yields before serve order is
known (:class:`Parsed`), the error of a bad line (:class:`BadLine`), decoding a JSON line
with errors in kvtool's words (:func:`decode`), and :class:`LineParser`, the interface a
format implements (kvtool/trace/formats/__init__.py registers them)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec

from kvtool.trace.hashing import TOKEN_MAX

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_MAX)]

_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "array": "a list",
               "object": "a JSON object", "bool": "true/false", "null": "null"}
_PATH_RE = r"^\$\.([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)"


class BadLine(Exception):
    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


# Parsed is built once per line: a msgspec Struct, whose construction runs in C (a
# NamedTuple's or a dataclass's runs Python code), for the reader's start-up time. gc=False:
# it holds numbers, strings and lists of ints, never a reference cycle.
class Parsed(msgspec.Struct, frozen=True, gc=False):
    """A validated line before serve-order fields (round inference, period) are known."""

    timestamp: float | None
    input_length: int
    output_length: int
    block_keys: list[int]
    block_tokens: int
    session: str | int | None
    round: int | None
    parent: str | int | None = None
    """Qwen-Bailian: ``parent_chat_id`` (None for a root); ``session`` holds ``chat_id``."""


def _words(type_expr: str) -> str:
    parts = [p.strip() for p in type_expr.split("|") if p.strip() != "null"]
    return " or ".join(_TYPE_WORDS.get(p, p) for p in parts)


def explain_validation(err: msgspec.ValidationError, raw: bytes) -> BadLine:
    """Turn msgspec's ``Expected `int`, got `str` - at `$.input_length``` into our words."""
    text = str(err)
    base, _, where = text.partition(" - at ")
    where = where.strip("`")
    field: str | None = None
    index = ""
    m = re.match(_PATH_RE, where)
    if m:
        field, index = m.group(1), m.group(2)
    got = ""
    value: Any = None
    try:
        value = json.loads(raw)
        if field is not None:
            value = value[field]
            for i in re.findall(r"\[(\d+)\]", index):
                value = value[int(i)]
        got = json.dumps(value)
        if len(got) > 40:
            got = got[:37] + "..."
    except (ValueError, KeyError, IndexError, TypeError):
        got = ""
    m2 = re.match(r"Expected `([^`]*)`(?:, got `([^`]*)`)?(.*)$", base)
    if m2:
        expected, _, rest = m2.groups()
        message = f"expected {_words(expected)}{rest}"
        if where == "" and field is None:
            message = f"each line must be {_words(expected)}"
    else:
        message = base[:1].lower() + base[1:]
    if got and where:
        message += f", got {got}"
    if index:
        message = f"item {index.strip('[]').replace('][', ',')}: {message}"
    return BadLine(message, field)


def decode(decoder: msgspec.json.Decoder[Any], raw: bytes) -> Any:
    """``decoder.decode(raw)``; a bad line raises :class:`BadLine` in kvtool's words."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as err:
        raise explain_validation(err, raw) from None
    except msgspec.DecodeError as err:
        text = str(err)
        if "truncated" in text:
            raise BadLine("malformed JSON: the line is truncated", None) from None
        raise BadLine(f"malformed JSON: {text.removeprefix('JSON is malformed: ')}",
                       None) from None




class LineParser:
    """One trace's line parser (a format module's ``Parser``), made by the reader once the
    block size is known: ``parse(raw, keys=...)`` one line (pass 1: ``keys=False``, block
    keys may be left empty; pass 2: ``keys=True``), plus the hooks below, which a format
    overrides where it needs them."""

    keep_block_ids: ClassVar[int] = 0
    """Pass 1 keeps decoded lines until they hold this many block ids (0: none kept)."""
    chunked: ClassVar[bool] = False
    """Lines decode a chunk at a time (the Mooncake fast paths of the reader)."""
    wants_header: ClassVar[bool] = False
    """The first non-blank line is a header (:meth:`header`)."""
    fresh_keys: ClassVar[bool] = False
    """The format has no prefix structure: every request gets new keys in serve order."""

    def __init__(self, path: str, block_tokens: int, *, explicit_block_tokens: int | None,
                 block_tokens_source: str) -> None:
        self.path = path
        self.block_tokens = block_tokens
        self.explicit_block_tokens = explicit_block_tokens
        self.block_tokens_source = block_tokens_source

    def parse(self, raw: bytes, *, keys: bool) -> Parsed:
        raise NotImplementedError

    def header(self, raw: bytes, line: int) -> None:
        """Take the header line (only when :attr:`wants_header`)."""

    def seen(self, req: Parsed, line: int) -> None:
        """Pass 1 met good line ``line``: a check across lines raises :class:`BadLine`."""

    def finish(self, entries: Sequence[Any]) -> None:
        """After pass 1, before serve order: adjust the entries (timestamps, sessions)."""

    def check_hash_ids(self, ids: list[int], input_length: int) -> None:
        allowed = -(-input_length // self.block_tokens)
        if len(ids) > allowed:
            raise BadLine(
                f"{len(ids)} block ids, but input_length {input_length} allows at most "
                f"{allowed} at {self.block_tokens} tokens per block", "hash_ids")

